"""One capture over several engines (`capture.num_engines`, CLI `--num-engines N`).

The prepared rows are cut into shards by a plan that depends on the rows' lengths alone
(`plan_shards`: where a one-engine capture closes its shards). Engine e captures the shards e, e+N,
e+2N, ... in a process of its own (`python -m eagle3.capture.engine_main`) with its own devices: for
the vllm backend a slice of `tensor_parallel_size` GPUs of CUDA_VISIBLE_DEVICES (tensor parallel
inside the engine), for the hf backend one GPU each; on a machine without GPUs every engine runs on
the CPU. All of them write into the one capture directory; the driver then writes the one manifest
as a one-engine capture does (eagle3.capture.run).

Same bytes whatever N: the backends batch the rows of a chunk together (vLLM schedules them in one
generate() call, the hf backend pads them into batches), so each engine runs exactly the chunks one
engine runs from row 0 (`chunk_bounds`) and drops the rows of a chunk that belong to a neighbouring
shard. Shard i's file is then the one a one-engine capture writes; a chunk that straddles two shards
is computed by both engines (at most one chunk per shard boundary: ~chunk_tokens / shard_tokens of
extra work). The boundaries equal a one-engine capture's unless a row turns out non-finite (that
capture does not count the tokens of a skipped row; the plan cannot know which rows will be).

Resume, per engine: each engine records every finished shard in progress-engine-<e>.json (with its
pid). A rerun, with any number of engines, keeps every recorded shard whose sha256 still matches
(and the shards of an interrupted one-engine capture's progress.json that fit the plan), merges them
into progress-engines.json, and deals only the missing shards out again. When every shard is done
the driver writes progress.json with all of them in order and removes the engine files; the manifest
follows.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.artifacts import ShardEntry
from eagle3.config import CaptureConfig, ConfigError
from eagle3.io import read_json, write_json
from eagle3.shards import (
    FORMAT,
    PROGRESS,
    check_capture_fits,
    corrupt_shards,
    estimate_storage,
    save_progress,
    shard_name,
)

from .chunks import chunk_end

#: an engine's progress file in the current run; earlier runs' shards are merged into
#: MERGED_PROGRESS
ENGINE_PROGRESS = "progress-engine-{engine}.json"
MERGED_PROGRESS = "progress-engines.json"
#: after one engine fails, the others get SIGTERM and this long before SIGKILL
STOP_GRACE_S = 30.0
#: the driver reports the shards done across engines this often (a `shard i/n` line: the Prefect
#: progress)
REPORT_EVERY_S = 5.0


# ----------------------------------------------------------------------------------------- the plan


def plan_shards(
    lengths: np.ndarray, shard_tokens: int, length_limit: int | None
) -> list[tuple[int, int]]:
    """[(first row, next row)] of every shard, cut where a one-engine capture cuts
    (eagle3.capture.run): a shard closes after the row that brings its captured tokens to
    shard_tokens; rows that are empty or too long (>= length_limit) are skipped and count nothing;
    trailing skipped rows join the last shard; all rows skipped: one (empty) shard."""
    shards: list[tuple[int, int]] = []
    first, tokens, num_rows = 0, 0, len(lengths)
    for i, n in enumerate(lengths.tolist()):
        if n > 0 and (length_limit is None or n < length_limit):
            tokens += n
            if tokens >= shard_tokens:
                shards.append((first, i + 1))
                first, tokens = i + 1, 0
    if first < num_rows:
        if tokens > 0 or not shards:
            shards.append((first, num_rows))
        else:  # only skipped rows after the last shard: they fold into it
            shards[-1] = (shards[-1][0], num_rows)
    return shards


def chunk_bounds(lengths: np.ndarray, chunk_tokens: int) -> list[int]:
    """First row of every chunk, as eagle3.capture.chunks.capture_rows cuts rows 0.. (at least one
    row per chunk, then rows while they fit chunk_tokens)."""
    starts, a, n = [], 0, len(lengths)
    lens = lengths.tolist()
    while a < n:
        starts.append(a)
        a = chunk_end(lens, range(n), a, chunk_tokens)
    return starts


def chunk_span(bounds: list[int], first: int, nxt: int, num_rows: int) -> tuple[int, int]:
    """The rows to run for the shard [first, nxt): from the start of the chunk holding `first` to
    the end of the chunk holding nxt - 1."""
    a = bounds[bisect.bisect_right(bounds, first) - 1]
    k = bisect.bisect_right(bounds, nxt - 1)
    return a, bounds[k] if k < len(bounds) else num_rows


# ------------------------------------------------------------------------------------------ devices


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES's entries when set, else every GPU
    torch sees."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [x.strip() for x in env.split(",") if x.strip() and x.strip() != "-1"]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except Exception:  # no usable CUDA: no GPU to hand out
        return []


def engine_environments(
    cfg: CaptureConfig, num_engines: int, gpus: list[str] | None = None
) -> list[dict[str, str]]:
    """The environment each engine's process starts with: its GPUs (CUDA_VISIBLE_DEVICES), or on the
    CPU its share of the cores (OMP_NUM_THREADS, unless set)."""
    gpus = visible_gpus() if gpus is None else gpus
    if cfg.backend == "hf" and cfg.device not in ("auto", "cuda", "cpu"):
        raise ConfigError(
            f"capture.device = {cfg.device!r} names one device, but num_engines = {num_engines} "
            "engines need one GPU each: use device auto (or cuda) and CUDA_VISIBLE_DEVICES to "
            "choose them"
        )
    on_cpu = not gpus or (cfg.backend == "hf" and cfg.device == "cpu")
    if on_cpu:
        threads = os.environ.get("OMP_NUM_THREADS") or str(
            max(1, (os.cpu_count() or 1) // num_engines)
        )
        return [{"OMP_NUM_THREADS": threads} for _ in range(num_engines)]
    per = cfg.tensor_parallel_size if cfg.backend == "vllm" else 1
    need = per * num_engines
    if len(gpus) < need:
        what = f"tensor_parallel_size {per}" if cfg.backend == "vllm" else "one GPU per hf engine"
        raise ConfigError(
            f"capture.num_engines = {num_engines} x {what} needs {need} GPUs, but this process "
            f"sees {len(gpus)} ({','.join(gpus) or 'none'}): lower num_engines (or "
            "tensor_parallel_size), or expose more GPUs with CUDA_VISIBLE_DEVICES"
        )
    return [
        {"CUDA_VISIBLE_DEVICES": ",".join(gpus[e * per : (e + 1) * per])}
        for e in range(num_engines)
    ]


# ----------------------------------------------------------------------------------------- progress


def engine_progress_files(out: Path) -> list[Path]:
    """Progress files of engines (this run's and the merged earlier ones)."""
    return sorted(Path(out).glob("progress-engine*.json"))


def wanted(cfg: CaptureConfig, out: Path) -> bool:
    """Capture with engines: more than one asked for, or an interrupted capture with engines is
    resumed (with any number of engines: a one-engine rerun finishes it the same way)."""
    return cfg.num_engines > 1 or bool(engine_progress_files(out))


def write_engine_progress(path: Path, config_hash: str, record: dict[str, Any]) -> None:
    write_json(path, {"format": FORMAT, "config_hash": config_hash, **record})


def collect_done(
    out: Path, config_hash: str, plan: list[tuple[int, int]]
) -> dict[int, dict[str, Any]]:
    """{shard id: progress entry} of every planned shard an earlier run finished whose file still
    matches its sha256 (from progress.json and the engine progress files). Other shard files and
    temp files are deleted; the entries are merged into MERGED_PROGRESS and this run's engine files
    start empty."""
    sources = [out / PROGRESS, *engine_progress_files(out)]
    entries: dict[str, dict[str, Any]] = {}
    for f in sources:
        if not f.is_file():
            continue
        prog = read_json(f)
        if prog.get("config_hash") != config_hash:
            raise ValueError(
                f"{f} belongs to a capture with different settings (config_hash "
                f"{prog.get('config_hash')} != {config_hash}): use a new --out directory or delete "
                f"{out} to start over"
            )
        for entry in prog.get("shards", []):
            entries.setdefault(entry["file"], entry)
    planned = {shard_name(i): (i, span) for i, span in enumerate(plan)}
    fits = [
        e
        for e in entries.values()
        if e["file"] in planned and (e["first_index"], e["next_index"]) == planned[e["file"]][1]
    ]
    bad = set(corrupt_shards(out, [ShardEntry.from_dict(e, str(out / PROGRESS)) for e in fits]))
    done = {planned[e["file"]][0]: e for e in fits if e["file"] not in bad}
    keep = {shard_name(i) for i in done}
    for f in out.glob("shard-*.safetensors"):
        if f.name not in keep:
            f.unlink()
    for f in out.glob(".shard-*.tmp"):  # a killed engine's half-written shard
        f.unlink()
    write_engine_progress(
        out / MERGED_PROGRESS, config_hash, {"shards": [done[i] for i in sorted(done)]}
    )
    for f in out.glob(ENGINE_PROGRESS.format(engine="*")):
        f.unlink()
    return done


# --------------------------------------------------------------------------------------- the driver


@dataclass
class Engine:
    index: int
    env: dict[str, str]
    shards: list[int]
    proc: subprocess.Popen | None = None
    tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=40))
    relay: threading.Thread | None = None

    @property
    def devices(self) -> str:
        return (
            f"GPUs {self.env['CUDA_VISIBLE_DEVICES']}"
            if "CUDA_VISIBLE_DEVICES" in self.env
            else "CPU"
        )


@dataclass
class EnginesRun:
    """What the engines did: every planned shard's progress entry, in order, and this run's
    figures."""

    shards: list[dict[str, Any]]
    num_resumed: int
    num_tokens: int
    capture_s: float
    info: dict[str, Any]


def capture_with_engines(
    cfg: CaptureConfig, ci: Any, config_hash: str, llm: Any = None
) -> EnginesRun:
    """Capture the shards of `ci` (eagle3.capture.inputs.CaptureInputs) not finished yet with
    cfg.num_engines engines; return every shard's entry once all are done (the caller writes the
    manifest)."""
    if llm is not None:
        raise ConfigError(
            f"capture.num_engines = {cfg.num_engines}: each engine starts in a process of its own, "
            "so an engine passed to run_capture cannot be used; pass none, or num_engines 1"
        )
    out = Path(cfg.out)
    plan = plan_shards(ci.lengths, cfg.shard_tokens, ci.length_limit)
    done = collect_done(out, config_hash, plan)
    todo = [i for i in range(len(plan)) if i not in done]
    n = cfg.num_engines
    envs = engine_environments(cfg, n)
    engines = [Engine(e, envs[e], todo[e::n]) for e in range(n)]
    remaining = int(sum(ci.lengths[a:b].sum() for a, b in (plan[i] for i in todo)))
    print(
        f"capture: {len(plan)} shards, {len(done)} done before; {len(todo)} to go ({remaining} "
        f"tokens) over {n} engine(s): "
        + "; ".join(f"engine {g.index} on {g.devices}: {len(g.shards)} shards" for g in engines),
        file=sys.stderr,
        flush=True,
    )
    new: dict[int, dict[str, Any]] = {}
    stats: list[dict[str, Any]] = []
    if todo:
        est = estimate_storage(
            len(ci.aux_layer_ids), ci.info.hidden_size, cfg.storage_dtype, remaining
        )
        check_capture_fits(out, est, cfg.min_free_disk_gb)
        new, stats = run_engines(
            cfg, config_hash, plan, [g for g in engines if g.shards], len(done)
        )
    entries = {**done, **new}
    missing = [shard_name(i) for i in range(len(plan)) if i not in entries]
    if missing:
        raise RuntimeError(
            f"capture: the engines ended without {len(missing)} planned shard(s) "
            f"({', '.join(missing[:5])}): run the same capture again to capture them"
        )
    shards = [entries[i] for i in range(len(plan))]
    save_progress(out, config_hash, shards)
    for f in engine_progress_files(out):
        f.unlink()
    capture_s = max((s["capture_s"] for s in stats), default=0.0)
    info = {"num_engines": n, "engines": stats, "plan_shards": len(plan)}
    return EnginesRun(shards, len(done), sum(s["num_tokens"] for s in stats), capture_s, info)


def run_engines(
    cfg: CaptureConfig,
    config_hash: str,
    plan: list[tuple[int, int]],
    engines: list[Engine],
    num_done_before: int,
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Start one process per engine, relay its output (prefixed), stop every engine when one fails
    (the error names it, its devices and its last lines); return the new entries by shard id and
    each engine's figures."""
    out = Path(cfg.out)
    with tempfile.TemporaryDirectory(prefix="eagle3-engines-") as tmp:
        try:
            for g in engines:
                _start_engine(cfg, config_hash, plan, g, Path(tmp))
            _wait(engines, out, num_done_before, len(plan))
        finally:
            _stop(engines)
    new: dict[int, dict[str, Any]] = {}
    stats = []
    for g in engines:
        rec = read_json(out / ENGINE_PROGRESS.format(engine=g.index))
        ids = {shard_name(i): i for i in g.shards}
        for entry in rec["shards"]:
            new[ids[entry["file"]]] = entry
        stats.append(
            {
                "engine": g.index,
                "devices": g.devices,
                "num_shards": len(rec["shards"]),
                "num_tokens": rec.get("num_tokens", 0),
                "capture_s": rec.get("capture_s", 0.0),
                "start_s": rec.get("start_s"),
                "tokens_per_s": rec.get("tokens_per_s", 0.0),
            }
        )
    return new, stats


def _start_engine(
    cfg: CaptureConfig, config_hash: str, plan: list[tuple[int, int]], g: Engine, tmp: Path
) -> None:
    """Write engine `g`'s job file into `tmp`, start its process (eagle3.capture.engine_main) in
    its own session and a thread that relays its output."""
    job = {
        "config": cfg.model_dump(mode="json"),
        "config_hash": config_hash,
        "engine": g.index,
        "num_engines": cfg.num_engines,
        "shards": [[i, *plan[i]] for i in g.shards],
        "progress": str(Path(cfg.out) / ENGINE_PROGRESS.format(engine=g.index)),
        "parent_pid": os.getpid(),
    }
    path = tmp / f"engine-{g.index}.json"
    write_json(path, job)
    g.proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "eagle3.capture.engine_main", str(path)],
        env={**os.environ, **g.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    g.relay = threading.Thread(
        target=_relay, args=(g,), daemon=True, name=f"eagle3-engine-{g.index}"
    )
    g.relay.start()


def _relay(g: Engine) -> None:
    assert g.proc is not None and g.proc.stdout is not None
    for line in g.proc.stdout:
        g.tail.append(line.rstrip("\n"))
        print(f"[engine {g.index}] {line}", end="", file=sys.stderr, flush=True)


def _count_done(out: Path, engines: list[Engine]) -> int:
    n = 0
    for g in engines:
        try:
            n += len(
                json.loads((out / ENGINE_PROGRESS.format(engine=g.index)).read_text()).get(
                    "shards", []
                )
            )
        except (OSError, ValueError):
            pass
    return n


def _wait(engines: list[Engine], out: Path, num_done_before: int, total: int) -> None:
    """Until every engine exited 0; the first one that fails raises (the caller stops the
    others)."""
    last_report, reported = time.monotonic(), -1
    while True:
        running = False
        for g in engines:
            rc = g.proc.poll() if g.proc is not None else 0
            if rc is None:
                running = True
            elif rc != 0:
                if g.relay is not None:
                    g.relay.join(timeout=5)
                how = f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
                last = "\n".join(g.tail)
                raise RuntimeError(
                    f"capture engine {g.index} of {len(engines)} ({g.devices}) {how}; the other "
                    "engines were stopped. Every shard already finished is kept: run the same "
                    f"capture again (any --num-engines) to resume. Its last output:\n{last}"
                )
        if time.monotonic() - last_report >= REPORT_EVERY_S or not running:
            num = num_done_before + _count_done(out, engines)
            if num != reported:
                print(f"capture: shard {num}/{total} done", file=sys.stderr, flush=True)
                reported = num
            last_report = time.monotonic()
        if not running:
            return
        time.sleep(0.2)


def _stop(engines: list[Engine]) -> None:
    """SIGTERM to every engine still running (its whole process group: vLLM's own processes too),
    SIGKILL after STOP_GRACE_S."""
    alive = [g for g in engines if g.proc is not None and g.proc.poll() is None]
    for g in alive:
        _signal_group(g.proc, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for g in alive:
        try:
            g.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(g.proc, signal.SIGKILL)
            g.proc.wait()
    for g in engines:
        if g.proc is not None:
            _signal_group(
                g.proc, signal.SIGKILL
            )  # whatever the engine left in its group (vLLM workers)
        if g.relay is not None:
            g.relay.join(timeout=5)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
