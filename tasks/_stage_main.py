"""Subprocess entry: `python -m eagle3_prefect.tasks._stage_main STAGE CONFIG_JSON RESULT_JSON`.

Runs one library stage function in a fresh process (clean CUDA / vLLM state) and writes either
{"ok": true, "result": ...} or {"ok": false, "kind": ..., "type": ..., "message": ...} to
RESULT_JSON. Exit status: 0 ok, 2 config/validation error, 3 out of memory, 1 anything else. Imports
no Prefect.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path


def start_parent_watchdog(interval_s: float = 2.0, grace_s: float = 10.0) -> threading.Thread:
    """If the task process that started us dies (even by SIGKILL), take our whole process group
    (vLLM engine cores included) down with us instead of running on as an orphan holding a GPU."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                print(
                    f"stage process: parent {parent} is gone; stopping process group",
                    file=sys.stderr,
                    flush=True,
                )
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(os.getpgrp(), sig)
                    except ProcessLookupError:
                        return
                    time.sleep(grace_s)

    t = threading.Thread(target=watch, name="eagle3-parent-watchdog", daemon=True)
    t.start()
    return t


def main(argv: list[str]) -> int:
    stage, config_json, result_json = argv
    start_parent_watchdog()
    import logging

    # the parent copies these lines into the run log; WARNING+ lines stay visible there
    # (eagle3.console)
    logging.basicConfig(
        level=os.environ.get("EAGLE3_LOG_LEVEL", "INFO").upper(),
        format="%(levelname)s %(name)s: %(message)s",
    )
    # vLLM applies VLLM_LOGGING_LEVEL when its logging is set up, after `import vllm` has already
    # logged
    logging.getLogger("vllm").setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
    from eagle3.diagnose import describe_failure
    from eagle3.stages import build_stage_config, jsonable, run_stage_function
    from eagle3.vllm_engine import setup_stage_process_env
    from eagle3_prefect.tasks.errors import classify_exception

    out = Path(result_json)
    try:
        values = json.loads(Path(config_json).read_text())
        cfg = build_stage_config(stage, values, source=f"{stage} config from the flow")
        # this process exists for this one stage: an engine stage's vLLM engine runs inside it
        # (eagle3.vllm_engine)
        setup_stage_process_env(stage, cfg)
        result = run_stage_function(stage, cfg)
    except BaseException as exc:  # classified and reported to the parent
        kind = classify_exception(exc)
        traceback.print_exc()
        message = describe_failure(exc) if isinstance(exc, Exception) else None
        out.write_text(
            json.dumps(
                {
                    "ok": False,
                    "kind": kind,
                    "type": type(exc).__name__,
                    "message": message or str(exc),
                }
            )
        )
        sys.stdout.flush()
        sys.stderr.flush()
        return {"config": 2, "oom": 3}.get(kind, 1)
    out.write_text(json.dumps({"ok": True, "result": jsonable(result)}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
