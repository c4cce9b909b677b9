"""Time one TTT training step at real dimensions (GPU): `python -m eagle3.train.bench --seq 4096`.

Needs only torch (no vLLM, pydantic or Prefect). Prints one JSON line per configuration: ms per optimizer
step, tokens/s, peak memory. `--check` first compares flex attention (values + grads) with the naive kernel.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from eagle3.model.draft import DraftConfig
from eagle3.train.attention import make_ttt_attention, naive_ttt_attention
from eagle3.train.step import build_benchmark, run_benchmark_step


def check_flex(device: str = "cuda") -> dict:
    B, T, steps, nh, kvh, d = 2, 512, 4, 8, 2, 64
    g = torch.Generator(device="cpu").manual_seed(0)
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, 200:] = 1
    doc[1, 300:] = -1
    doc = doc.to(device)
    mk = lambda *s: torch.randn(*s, generator=g).to(device).requires_grad_()  # noqa: E731
    q = mk(B, nh, T, d)
    ks = [mk(B, kvh, T, d) for _ in range(steps)]
    vs = [mk(B, kvh, T, d) for _ in range(steps)]
    leaves = [q, *ks, *vs]
    ref = naive_ttt_attention(q, ks, vs, doc)
    out = {}
    for kind in ("flex", "sdpa"):
        got = make_ttt_attention(kind, doc, steps)(q, ks, vs)
        w = torch.randn_like(ref)
        ga = torch.autograd.grad((got * w).sum(), leaves)
        gb = torch.autograd.grad((ref * w).sum(), leaves, retain_graph=True)
        out[kind] = {"max_abs_out": (got - ref).abs().max().item(),
                     "max_abs_grad": max((a - b).abs().max().item() for a, b in zip(ga, gb, strict=True))}
    return out


def real_config(args) -> DraftConfig:
    return DraftConfig(hidden_size=args.hidden, intermediate_size=args.inter, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv, head_dim=args.hidden // args.heads, max_position_embeddings=131072,
                       rms_norm_eps=1e-5, vocab_size=args.vocab, draft_vocab_size=args.draft_vocab,
                       target_hidden_size=args.hidden, num_aux=3, rope_theta=500000.0)


def bench(args, seq: int) -> dict:
    s = build_benchmark(real_config(args), batch_size=args.batch, seq_len=seq, steps=args.steps, device="cuda",
                        dtype=torch.bfloat16, attention=args.attention, compile=args.compile)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(args.warmup):
        run_benchmark_step(s)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        out = run_benchmark_step(s)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / args.iters * 1e3
    return {"seq": seq, "batch": args.batch, "ttt_steps": args.steps, "attention": args.attention,
            "compile": args.compile, "ms_per_step": round(ms, 2), "tokens_per_s": round(args.batch * seq / ms * 1e3),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "loss": float(out.loss)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, nargs="+", default=[2048])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv", type=int, default=8)
    p.add_argument("--inter", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--attention", default="flex")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    if args.check:
        print(json.dumps({"check": check_flex()}), flush=True)
    for seq in args.seq:
        print(json.dumps(bench(args, seq)), flush=True)


if __name__ == "__main__":
    main()
