"""One engine of a capture over several (eagle3.capture.engines starts it):

    python -m eagle3.capture.engine_main JOB.json

JOB names the capture's config, its config hash, this engine's index and its shards ([id, first row,
next row]). The engine starts its backend on the devices its environment gives it, runs for each
shard the chunks a one-engine capture runs (eagle3.capture.engines.chunk_span), keeps the shard's
rows, writes the shard into the capture directory and records its entry in its progress file
(progress-engine-<e>.json, with this process's pid). It ends with its parent (SIGTERM when the
driver dies) and closes its backend on SIGTERM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from eagle3.config import CaptureConfig
from eagle3.io import read_json, sha256_json
from eagle3.shards import ShardBuffer
from eagle3.vllm_engine import engine_in_process_fails, setup_cpu_env

from .backend import open_backend
from .chunks import capture_rows
from .engines import chunk_bounds, chunk_span, write_engine_progress
from .inputs import CaptureInputs, load_capture_inputs
from .writer import ShardWriter


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the driver that started it dies (Linux); exit now if it is already
    gone."""
    try:
        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the driver's own cleanup stops the engines
        pass
    if os.getppid() != parent_pid:
        sys.exit(f"capture engine: the driver (pid {parent_pid}) is gone")


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the backend's close()


def main(argv: list[str]) -> int:
    job = read_json(argv[0])
    die_with_parent(int(job["parent_pid"]))
    signal.signal(signal.SIGTERM, _on_sigterm)
    cfg = CaptureConfig.model_validate(job["config"])
    if cfg.backend == "vllm":
        # on the CPU this process exists only for its engine: run it in process (no GPU: nothing is
        # set)
        setup_cpu_env(engine_in_process=not engine_in_process_fails(cfg.target))
    ci = load_capture_inputs(cfg)
    got = sha256_json(ci.hashed)
    if got != job["config_hash"]:
        raise RuntimeError(
            f"capture engine {job['engine']}: its inputs hash to {got}, the driver's to "
            f"{job['config_hash']} (a file changed while the capture started?): run the capture "
            "again"
        )
    capture_shards(cfg, ci, job)
    return 0


def capture_shards(cfg: CaptureConfig, ci: CaptureInputs, job: dict[str, Any]) -> None:
    """Capture and write the job's shards, recording each in the engine's progress file."""
    progress = Path(job["progress"])
    t_start = time.time()
    record: dict[str, Any] = {
        "engine": job["engine"],
        "num_engines": job["num_engines"],
        "pid": os.getpid(),
        "devices": os.environ.get("CUDA_VISIBLE_DEVICES", "cpu"),
        "shards": [],
        "num_tokens": 0,
        "capture_s": 0.0,
        "tokens_per_s": 0.0,
        "start_s": None,
    }
    write_engine_progress(progress, job["config_hash"], record)
    backend = open_backend(cfg, ci)
    try:
        info = backend.start()
        chunk_tokens = int(info.get("chunk_tokens", cfg.batch_tokens))
        bounds = chunk_bounds(ci.lengths, chunk_tokens)
        t_cap = time.time()
        record["start_s"] = round(t_cap - t_start, 2)

        def done(entry: dict[str, Any]) -> None:
            record["shards"].append(entry)
            record["capture_s"] = round(time.time() - t_cap, 3)
            record["tokens_per_s"] = round(record["num_tokens"] / max(record["capture_s"], 1e-9), 1)
            write_engine_progress(progress, job["config_hash"], record)

        writer = ShardWriter(
            cfg, backend, Path(cfg.out), len(ci.aux_layer_ids), ci.info.hidden_size, done
        )
        for shard_id, first, nxt in job["shards"]:
            a, b = chunk_span(bounds, first, nxt, ci.n_total)
            buf = ShardBuffer(first_index=first, next_index=first)
            for r in capture_rows(
                backend,
                ci.ds,
                ci.lengths,
                range(a, b),
                chunk_tokens,
                ci.length_limit,
                refs=writer.worker,
            ):
                if first <= r.index < nxt:  # not a neighbouring shard's row of a shared chunk
                    record["num_tokens"] += writer.add(buf, r)
            buf.next_index = nxt  # the skipped rows at its end belong to it too
            writer.write(shard_id, buf)
        writer.finish()
    finally:
        backend.close()


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # the driver shows this output when the engine fails
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a shut-down vLLM engine can hang the interpreter's teardown for minutes
