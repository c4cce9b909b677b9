"""Measured time of one target pass in vLLM: t new tokens per sequence over b sequences, on a stack
shaped like a real target's layers with random weights (vLLM's dummy loader: no checkpoint).

    python benchmarks/vllm_gpu/step_time.py --target-config configs/targets/kimi-k2.5.json \
        --num-layers 4 --out R.json [--experts int4] [--t 1,2,3,4,5,6] [--b 1,4,16] \
        [--context 1024] [--gpu-memory-utilization 0.85]

A verification pass of k draft tokens is a target pass of t = k + 1 query tokens per sequence; its
cost on a MoE target grows with the distinct experts the t·b tokens wake (eagle3's step-time model
predicts it). This measures the pass itself, through vLLM's public API only:

- decode step (t = 1): b sequences whose `--context` prompt tokens are in the prefix cache decode
  N + 1 tokens and 1 token; the step time is the difference over N (the per-request set-up cancels).
- pass of t tokens: the same cached prompts plus t fresh tokens each, one new token asked: the
  engine computes exactly t query tokens per sequence in one step (the prefix is a hit; the tail is
  shorter than a block). The call's fixed cost cancels against the t = 1 call of the same form:
  pass(t) = decode step + call(t) - call(1), each call the median of `--repeats` runs.

The stack: the target config's text model with `num_hidden_layers` = `--num-layers` (DeepSeek-V3 /
Kimi: the first `first_k_dense_replace` layers dense, the rest MoE), bfloat16, or with `--experts
int4` the target config's own quantization (Kimi-K2.5: compressed-tensors INT4 W4A16 routed
experts, group 32, served by vLLM's Marlin MoE kernels). Writes R.json and R.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def write_stack(target_config: Path, num_layers: int, experts: str, out: Path) -> dict[str, Any]:
    """config.json of the target's text model cut to `num_layers` layers (weights: dummy). `experts`
    "bf16": every weight bfloat16; "int4": the target config's own quantization_config (Kimi-K2.5:
    compressed-tensors INT4 W4A16 routed experts, group 32), which it must have."""
    cfg = json.loads(target_config.read_text())
    text = dict(cfg.get("text_config") or cfg)
    quant = text.pop("quantization_config", None) or cfg.get("quantization_config")
    if experts == "int4":
        if not quant:
            raise SystemExit(
                f"{target_config}: no quantization_config, so --experts int4 has no scheme to "
                "serve; use --experts bf16 or a target config that carries its quantization"
            )
        text["quantization_config"] = quant
    text["num_hidden_layers"] = num_layers
    text.setdefault("torch_dtype", "bfloat16")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(text, indent=1))
    return text


def measure(llm: Any, b: int, ts: list[int], context: int, repeats: int, vocab: int, seed: int):
    """Decode-step time and pass time per t for b sequences (seconds); see the module docstring."""
    import numpy as np
    from vllm import SamplingParams

    from eagle3.evaluate.engine import metrics_since, read_metrics

    rng = np.random.default_rng(seed + b)
    prefixes = [rng.integers(100, vocab - 100, size=context).tolist() for _ in range(b)]
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def call(prompts: list[list[int]], params: Any) -> float:
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0

    call(prefixes, one)  # the prefixes enter the prefix cache
    num_decode = 32
    many = SamplingParams(
        max_tokens=num_decode + 1, temperature=0.0, ignore_eos=True, detokenize=False
    )
    decode = []
    for _ in range(max(3, repeats // 2)):
        decode.append((call(prefixes, many) - call(prefixes, one)) / num_decode)
    step_s = statistics.median(decode)
    calls: dict[int, float] = {}
    computed: dict[int, float] = {}
    for t in sorted(set([1, *ts])):
        runs = []
        before = read_metrics(llm.get_metrics())
        for _ in range(repeats + 1):
            tails = [rng.integers(100, vocab - 100, size=t).tolist() for _ in range(b)]
            runs.append(call([p + tl for p, tl in zip(prefixes, tails, strict=True)], one))
        calls[t] = statistics.median(runs[1:])  # the first: warm-up of this shape
        # the check that each pass computed t tokens per sequence: prompt tokens not found in
        # the prefix cache, per sequence and call (vLLM's own counters)
        grown = metrics_since(read_metrics(llm.get_metrics()), before)
        queried = grown.get("vllm:prefix_cache_queries", 0)
        hits = grown.get("vllm:prefix_cache_hits", 0)
        computed[t] = (queried - hits) / (b * (repeats + 1)) if queried else float("nan")
    passes = {t: step_s + calls[t] - calls[1] for t in ts}
    return {
        "b": b,
        "decode_step_s": step_s,
        "decode_step_runs_s": decode,
        "call_s": {str(t): v for t, v in calls.items()},
        "computed_tokens_per_sequence": {str(t): v for t, v in computed.items()},
        "pass_s": {str(t): v for t, v in passes.items()},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import vllm
    from vllm import LLM

    from eagle3.vllm_engine import shutdown_engine

    ts = [int(x) for x in args.t.split(",")]
    bs = [int(x) for x in args.b.split(",")]
    with tempfile.TemporaryDirectory(prefix="eagle3-step-") as tmp:
        text = write_stack(args.target_config, args.num_layers, args.experts, Path(tmp))
        max_tokens = max(ts) * max(bs)
        t0 = time.time()
        llm = LLM(
            model=tmp,
            load_format="dummy",
            skip_tokenizer_init=True,
            dtype=args.dtype,
            max_model_len=args.context + 64,
            max_num_seqs=max(bs),
            max_num_batched_tokens=max(max_tokens, 2048, args.context + 64),
            enable_prefix_caching=True,
            gpu_memory_utilization=args.gpu_memory_utilization,
            seed=0,
            enforce_eager=args.eager,
            disable_log_stats=False,  # the prefix-cache counters of the check
        )
        startup_s = time.time() - t0
        rows = []
        try:
            for b in bs:
                rows.append(
                    measure(llm, b, ts, args.context, args.repeats, int(text["vocab_size"]), 0)
                )
                print(
                    json.dumps({k: v for k, v in rows[-1].items() if k != "decode_step_runs_s"}),
                    flush=True,
                )
        finally:
            shutdown_engine(llm)
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": (
            torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.machine()
        ),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "runner": "V2" if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "") == "1" else "default",
        "enforce_eager": args.eager,
        "dtype": args.dtype,
        "target_config": str(args.target_config),
        "num_layers": args.num_layers,
        "first_k_dense_replace": text.get("first_k_dense_replace", 0),
        "experts": args.experts,
        "context": args.context,
        "repeats": args.repeats,
        "engine_startup_s": round(startup_s, 1),
        "config": text,
        "stack": {
            k: text.get(k)
            for k in (
                "hidden_size",
                "moe_intermediate_size",
                "n_routed_experts",
                "num_experts_per_tok",
                "n_shared_experts",
                "kv_lora_rank",
                "q_lora_rank",
                "num_attention_heads",
                "vocab_size",
            )
        },
        "command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "rows": rows,
    }


def add_model(rec: dict[str, Any], hardware: str) -> dict[str, Any]:
    """Beside each measured pass, eagle3's step-time model of it on `hardware` (one GPU, routing
    uniform: random weights route every token to near-uniform experts), and measured / model."""
    from eagle3.step_time import predict_pass_time_s

    cfg = rec["config"]
    rec["model"] = {"hardware": hardware, "tp": 1, "routing": "uniform bound"}
    for r in rec["rows"]:
        r["model_pass_s"], r["model_breakdown"] = {}, {}
        for t in r["pass_s"]:
            p = predict_pass_time_s(
                cfg, hardware, tp=1, t=int(t), b=r["b"], context_len=rec["context"]
            )
            r["model_pass_s"][t] = p.total_s
            r["model_breakdown"][t] = {
                k: getattr(p, k)
                for k in (
                    "memory_s",
                    "compute_s",
                    "comm_s",
                    "overhead_s",
                    "distinct_experts_per_layer",
                    "bound",
                )
            }
    return rec


def markdown(rec: dict[str, Any]) -> str:
    ts = sorted({int(t) for r in rec["rows"] for t in r["pass_s"]})
    lines = [
        f"# Target pass time in vLLM: t tokens per sequence x b sequences ({rec['date']})",
        "",
        f"- device: {rec['device']}; vLLM {rec['vllm']}, torch {rec['torch']}; runner "
        f"{rec['runner']}; CUDA graphs {'off' if rec['enforce_eager'] else 'on'}",
        f"- stack: {rec['target_config']} text model, {rec['num_layers']} layers "
        f"({rec['first_k_dense_replace']} dense), routed experts {rec['experts']}, random weights; "
        f"{rec['context']} tokens of context per sequence",
        f"- command: `{rec['command']}`",
        "",
        "| b | decode step ms | " + " | ".join(f"t={t} ms" for t in ts) + " |",
        "|---:|---:|" + "---:|" * len(ts),
    ]
    for r in rec["rows"]:
        cells = " | ".join(f"{r['pass_s'][str(t)] * 1e3:.2f}" for t in ts)
        lines.append(f"| {r['b']} | {r['decode_step_s'] * 1e3:.2f} | {cells} |")
    if "model" in rec:
        m = rec["model"]
        lines += [
            "",
            f"eagle3's step-time model on the `{m['hardware']}` profile (tp {m['tp']}, "
            f"{m['routing']}): model ms (measured / model)",
            "",
            "| b | " + " | ".join(f"t={t}" for t in ts) + " |",
            "|---:|" + "---:|" * len(ts),
        ]
        for r in rec["rows"]:
            cells = " | ".join(
                f"{r['model_pass_s'][str(t)] * 1e3:.2f} "
                f"({r['pass_s'][str(t)] / r['model_pass_s'][str(t)]:.2f})"
                for t in ts
            )
            lines.append(f"| {r['b']} | {cells} |")
    return "\n".join(lines) + "\n"


def write(rec: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rec, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rec))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-config", type=Path, help="the target's config.json")
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--out", type=Path, required=True, help="R.json (R.md beside it)")
    ap.add_argument("--experts", choices=("bf16", "int4"), default="bf16")
    ap.add_argument("--t", default="1,2,3,4,5,6", help="query tokens per sequence")
    ap.add_argument("--b", default="1,4,16", help="sequences per pass")
    ap.add_argument("--context", type=int, default=1024, help="cached tokens per sequence")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs, no torch.compile")
    ap.add_argument("--dtype", default="bfloat16", help="float32 on a CPU")
    ap.add_argument(
        "--hardware",
        help="also eagle3's step-time model of each pass on this profile (eagle3.hardware)",
    )
    ap.add_argument(
        "--model-only",
        type=Path,
        help="no engine: add the model (--hardware) to this earlier record, written to --out",
    )
    args = ap.parse_args()
    if args.model_only:
        rec = json.loads(args.model_only.read_text())
    elif args.target_config is None or args.num_layers is None:
        ap.error("--target-config and --num-layers are needed to measure (or --model-only R.json)")
    else:
        rec = run(args)
    write(rec, args.out)
    if args.hardware:  # after the measurement is safe on disk
        write(add_model(rec, args.hardware), args.out)
    print(markdown(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
