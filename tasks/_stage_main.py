"""Subprocess entry: `python -m tasks._stage_main STAGE CONFIG_JSON RESULT_JSON`.

Runs one library stage function in a fresh process (clean CUDA / vLLM state) and writes either
{"ok": true, "result": ...} or {"ok": false, "kind": ..., "type": ..., "message": ...} to RESULT_JSON.
Exit status: 0 ok, 2 config/validation error, 3 out of memory, 1 anything else. Imports no Prefect.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def main(argv: list[str]) -> int:
    stage, config_json, result_json = argv
    from eagle3.cli import _jsonable, resolve_function
    from eagle3.config import build_stage_config
    from tasks.errors import classify_exception

    out = Path(result_json)
    try:
        values = json.loads(Path(config_json).read_text())
        cfg = build_stage_config(stage, values, source=f"{stage} config from the flow")
        result = resolve_function(stage)(cfg)
    except BaseException as exc:  # noqa: BLE001 - classified and reported to the parent
        kind = classify_exception(exc)
        traceback.print_exc()
        out.write_text(json.dumps({"ok": False, "kind": kind, "type": type(exc).__name__, "message": str(exc)}))
        sys.stdout.flush()
        sys.stderr.flush()
        return {"config": 2, "oom": 3}.get(kind, 1)
    out.write_text(json.dumps({"ok": True, "result": _jsonable(result)}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
