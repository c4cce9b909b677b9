#!/usr/bin/env python3
"""EAGLE-3 TTT training step on one GPU: FLOP/byte floors, measured matmul rate + HBM bandwidth,
fast path vs naive.

    # H200, real dims
    PYTHONPATH=src python3 benchmarks/train_step.py --budget-s 240 --out-dir $OUT
    # tiny CPU run, temp dir
    PYTHONPATH=src python3 benchmarks/train_step.py --smoke
    # one call: ours (Llama-8B + Kimi-K2.5 dims) + the peer + compile cache round trip
    # [+ --ddp N], merged by benchmarks/step_vs_peer.py
    bash benchmarks/gpu_step_vs_peer.sh

One run reports, side by side (benchmarks/results/train_step.{json,md} unless --out-dir / --smoke):
  1. the FLOP model (per token, summed over the K TTT steps; see `flop_model`) and the bytes floor
     (weights + grads + AdamW state read/written per optimizer step; see `bytes_model`) -> floor =
     max(FLOPs/rate, bytes/BW)
  2. the bf16 matmul rate (8192^3 torch.matmul, mean of 10 after warm-up) and HBM bandwidth (4 GiB
     device copy) measured in this run -> MFU = achieved model FLOP/s / measured bf16 matmul rate
  3. configurations: the fast path (`step_setup.run_benchmark_step`, flex attention, torch.compile'd
     midlayer where it pays) at seq 2048/4096/8192 with K=7 and K=3 at 8192, and the naive reference
     (full materialized TTT mask via attention="naive", loss in one unchunked chunk) at 2048 and
     8192 (OOM caught); ms/step = median of N timed steps (CUDA events; no host sync inside the
     timed loop except the final one)
  4. numerics: fast path vs naive reference, loss + all grads, on a small random draft (bf16
     autocast and fp32)
  5. a wall-clock budget (--budget-s): configs that do not fit are skipped, iterations shrink to
     fit, a watchdog writes whatever was measured if one config overruns; results are rewritten
     after every config.

Batch: one packed row per step (batch 1, two documents per row) like the Speculators anchor, so
tokens/step = seq; `--fill-batch N` appends a K=7/8192 run at batch N (room for batch > 1). Imports
only torch + stdlib and the pydantic-free eagle3.model / eagle3.train.{step,attention,loss,bench}
modules.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1] / "src")
)  # works without PYTHONPATH=src too

from eagle3.flops import count_step_bytes as bytes_model
from eagle3.flops import count_train_flops as flop_model
from eagle3.model.draft import DraftConfig
from eagle3.train import attention
from eagle3.train.step import StepOutput, TTTModule, ttt_forward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, describe_machine, fmt, utc_now, write_result
from step_setup import build_benchmark, check_flex, run_benchmark_step

#: Llama-3.1-8B-like draft
REAL = dict(H=4096, Ht=4096, n_aux=3, nh=32, kvh=8, d=128, inter=14336, V=128256, Vd=32000)
#: Kimi-K2.5's draft (configs/kimi-k2.5.yaml train.draft over configs/targets/kimi-k2.5.json: hidden
#: 7168, 64 heads of 112, intermediate 18432, draft vocab 32000 over the 163,840-token target vocab)
KIMI = dict(H=7168, Ht=7168, n_aux=3, nh=64, kvh=64, d=112, inter=18432, V=163840, Vd=32000)
#: --dims name -> dims
DIMS = {"llama-3.1-8b": REAL, "kimi-k2.5": KIMI}
#: tiny dims for --smoke (CPU)
SMOKE = dict(H=32, Ht=32, n_aux=3, nh=4, kvh=2, d=8, inter=64, V=256, Vd=64)
#: the numerics check's draft
CHECK = dict(H=128, Ht=128, n_aux=3, nh=4, kvh=2, d=32, inter=256, V=1024, Vd=256)

#: efficiency the prediction assumes for bf16 matmul work (the issue's goal: ~65% MFU)
PRED_EFF = 0.65
#: dense bf16 spec peak, only for an extra reference column (MFU proper uses the measured rate)
SPEC_BF16 = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


# --------------------------------------------------------------------------------------- FLOP model
# flop_model / bytes_model: eagle3.flops (one copy, shared with `eagle3 plan`)


def naive_extra(m: dict, B: int, T: int, K: int) -> dict:
    """What the naive reference executes on top of the model: attention over the full concatenated
    key axis ((j+1)T keys, no causal skipping) in fp32 matmuls, and the (B, nh, T, (j+1)T) fp32
    score/prob tensors materialized (~6 passes of 4 B each forward, ~6 backward)."""
    nh, d = m["nh"], m["d"]
    fp32_flops = 3 * B * T * sum(4 * nh * d * (j + 1) * T for j in range(K))
    elems = B * nh * T * T * sum(j + 1 for j in range(K))
    return {
        "attn_fp32_flops": float(fp32_flops),
        "score_elems": float(elems),
        "score_bytes": float(48 * elems),
    }


# ------------------------------------------------------------------------------------------- timing


class Clock:
    """CUDA events on GPU (no host sync until `elapsed`), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def elapsed_ms(self, marks: list) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(marks[:-1], marks[1:], strict=True)]
        return [(b - a) * 1e3 for a, b in zip(marks[:-1], marks[1:], strict=True)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure_matmul(device, n: int, dtype, iters: int = 10, warmup: int = 3) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(warmup):
        a @ b
    sync(device)
    clk = Clock(device)
    marks = [clk.mark()]
    for _ in range(iters):
        a @ b
        marks.append(clk.mark())
    ms = statistics.mean(clk.elapsed_ms(marks))
    del a, b
    return 2 * n**3 / (ms / 1e3)


def measure_bandwidth(device, nbytes: int, iters: int = 10, warmup: int = 3) -> float:
    x = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).fill_(1.0)
    y = torch.empty_like(x)
    for _ in range(warmup):
        y.copy_(x)
    sync(device)
    clk = Clock(device)
    marks = [clk.mark()]
    for _ in range(iters):
        y.copy_(x)
        marks.append(clk.mark())
    ms = statistics.mean(clk.elapsed_ms(marks))
    del x, y
    return 2 * nbytes / (ms / 1e3)  # read + write


# -------------------------------------------------------------------------------------- model setup


def draft_config(m: dict) -> DraftConfig:
    return DraftConfig(
        hidden_size=m["H"],
        intermediate_size=m["inter"],
        num_attention_heads=m["nh"],
        num_key_value_heads=m["kvh"],
        head_dim=m["d"],
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        vocab_size=m["V"],
        draft_vocab_size=m["Vd"],
        target_hidden_size=m["Ht"],
        num_aux=m["n_aux"],
        rope_theta=500000.0,
    )


def naive_step(s, grad_clip: float = 0.5):
    """The reference step: attention="naive" (full (T, (j+1)T) mask, fp32 scores) and the loss in
    one chunk over all rows (the full (B*T, Vd) fp32 log-softmax materialized per TTT step); same
    clip + AdamW as the fast path."""
    B, T = s.batch.input_ids.shape
    dev = s.batch.input_ids.device.type
    params = inspect.signature(ttt_forward).parameters
    kw = {"loss_chunk_rows": B * T} if "loss_chunk_rows" in params else {}
    if "fused_loss" in params:
        kw["fused_loss"] = False  # the reference keeps autograd's unfused loss
    with torch.autocast(dev, dtype=s.dtype, enabled=s.dtype != torch.float32):
        out = ttt_forward(s.model, s.batch, s.head, steps=s.steps, attention="naive", **kw)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(s.model.parameters(), grad_clip, foreach=True)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return out


def ddp_step(s, ddp, grad_clip: float = 0.5):
    """The fast step through DistributedDataParallel (eagle3.train.parallel.wrap around TTTModule,
    as the trainer does): each rank trains its own packed row; gradients are all-reduced during
    backward."""
    with torch.autocast(
        s.batch.input_ids.device.type, dtype=s.dtype, enabled=s.dtype != torch.float32
    ):
        loss, _ = ddp(s.batch, s.head, steps=s.steps, attention=s.attention)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(s.model.parameters(), grad_clip, foreach=True)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return StepOutput(loss, None)


def host_sync_sites(fn, device) -> list[str] | None:
    """Run fn once with torch.cuda sync-debug mode on: the Python line (file:line) of every call
    that synchronized host and GPU, in order (None on CPU). Their number is host_syncs_per_step; a
    new one names its place."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [
        f"{Path(x.filename).name}:{x.lineno}" for x in w if "synchroniz" in str(x.message).lower()
    ]


# ----------------------------------------------------------------------------------------- numerics


def numerics_check(
    device: torch.device, fast_attention: str, T: int, K: int = 3, B: int = 2
) -> dict:
    """Fast path vs naive reference on a small random draft: loss + every grad.
    Reference = naive attention in fp32 (no autocast). Under bf16 autocast the fast path passes if
    its error vs the reference is within 2x the naive-bf16 error (or 1e-2 rel loss / 2e-2 rel grad);
    `fp32_pass`: fp32 fast path within 1e-3 rel (reported; a TF32 kernel would miss it without being
    wrong at bf16)."""
    cfg = draft_config(CHECK)
    s = build_benchmark(
        cfg,
        batch_size=B,
        seq_len=T,
        steps=K,
        device=str(device),
        dtype=torch.float32,
        attention="naive",
        compile=False,
    )
    model = s.model

    def run(att, amp):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = ttt_forward(model, s.batch, s.head, steps=K, attention=att)
        out.loss.backward()
        return out.loss.detach().double(), {
            n: p.grad.detach().double().clone()
            for n, p in model.named_parameters()
            if p.grad is not None
        }

    def err(a, b):
        (la, ga), (lb, gb) = a, b
        rel = max(
            ((ga[n] - gb[n]).abs().max() / gb[n].abs().max().clamp(min=1e-12)).item() for n in gb
        )
        return {"loss_rel": (abs(la - lb) / abs(lb).clamp(min=1e-12)).item(), "grad_rel_max": rel}

    ref = run("naive", False)
    res = {"dims": CHECK, "B": B, "T": T, "K": K, "fast_attention": fast_attention}
    res["fp32_fast_vs_ref"] = err(run(fast_attention, False), ref)
    nb = err(run("naive", True), ref)
    fb_run = run(fast_attention, True)
    fb = err(fb_run, ref)
    res["bf16_naive_vs_ref"], res["bf16_fast_vs_ref"] = nb, fb
    res["bf16_fast_vs_naive"] = err(fb_run, run("naive", True))
    ok32 = (
        res["fp32_fast_vs_ref"]["loss_rel"] < 1e-3
        and res["fp32_fast_vs_ref"]["grad_rel_max"] < 1e-3
    )
    ok16 = (fb["loss_rel"] <= max(2 * nb["loss_rel"], 1e-2)) and (
        fb["grad_rel_max"] <= max(2 * nb["grad_rel_max"], 2e-2)
    )
    res["fp32_pass"], res["pass"] = bool(ok32), bool(ok16)  # pass = the bf16 criterion
    return res


# --------------------------------------------------------------------------------------- one config


PROFILE_GROUPS = (  # kernel-name substrings -> group, first match wins
    ("flex attention", ("flex", "triton_tem")),
    ("matmul (cuBLAS/CUTLASS)", ("gemm", "cutlass", "xmma", "nvjet", "sm90_", "cublas")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("fused triton (compiled)", ("triton_",)),
    ("reductions/softmax", ("reduce", "softmax", "norm", "max", "sum")),
    ("copies/casts", ("copy", "cast", "fill", "cat", "index", "gather", "scatter")),
)


def profile_steps(step, device, out_dir: Path, name: str, steps: int = 2) -> dict:
    """torch.profiler over `steps` steps: GPU time by kernel group and the top kernels (written to
    train_step_profile.txt) -- where a step's time goes beyond the FLOP model."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    events = [
        e
        for e in prof.key_averages()
        if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"
    ]
    total_us = sum(e.device_time_total for e in events) or 1.0
    groups: dict[str, float] = {}
    for e in events:
        low = e.key.lower()
        g = next((g for g, keys in PROFILE_GROUPS if any(k in low for k in keys)), "other")
        groups[g] = groups.get(g, 0.0) + e.device_time_total
    top = sorted(events, key=lambda e: -e.device_time_total)[:40]
    text = prof.key_averages().table(
        sort_by="device_time_total", row_limit=60, max_name_column_width=90
    )
    shapes = prof.key_averages(group_by_input_shape=True).table(
        sort_by="device_time_total",
        row_limit=40,
        max_name_column_width=60,
        max_shapes_column_width=110,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "train_step_profile.txt").write_text(
        f"# {name}: torch.profiler over {steps} steps\n{text}\n\n"
        f"# by op and input shape\n{shapes}\n"
    )
    return {
        "steps": steps,
        "gpu_ms_per_step": total_us / 1e3 / steps,
        "groups_ms_per_step": {
            g: round(v / 1e3 / steps, 2) for g, v in sorted(groups.items(), key=lambda x: -x[1])
        },
        "top_kernels": [
            {
                "kernel": e.key[:120],
                "ms_per_step": round(e.device_time_total / 1e3 / steps, 3),
                "calls_per_step": e.count // steps,
            }
            for e in top
        ],
    }


def run_config(c: dict, m: dict, device, args, deadline: float, rates: dict) -> dict:
    T, K, B, kind = c["seq"], c["K"], c["batch"], c["kind"]
    fm, bm = flop_model(m, T, K), bytes_model(m, K)
    world = args.dist.world if args.dist else 1
    tokens = B * T * world  # per optimizer step, all ranks
    if world > 1:
        c = dict(c, name=f"{c['name']} DDP×{world}", world=world)
    model_flops = fm["model_flops_per_token"] * tokens
    compute_floor = model_flops / (
        rates["bf16_matmul_flops"] * world
    )  # each rank at the measured rate
    bytes_floor = bm["bytes_per_step"] / rates["hbm_bytes_per_s"]
    r = dict(
        c,
        tokens_per_step=tokens,
        model_flops_per_step=model_flops,
        floor_ms=1e3 * max(compute_floor, bytes_floor),
        compute_floor_ms=1e3 * compute_floor,
        bytes_floor_ms=1e3 * bytes_floor,
    )
    if kind == "fast":
        pred = max(compute_floor / PRED_EFF, bytes_floor)
        r["prediction_basis"] = f"model FLOPs at {PRED_EFF:.0%} of the measured bf16 matmul rate"
    else:
        ne = naive_extra(m, B, T, K)
        attn_bf16 = 3 * fm["forward_per_token"]["attn_core"] * tokens
        pred = (
            (model_flops - attn_bf16) / (PRED_EFF * rates["bf16_matmul_flops"])
            + ne["attn_fp32_flops"] / rates["fp32_matmul_flops"]
            + ne["score_bytes"] / rates["hbm_bytes_per_s"]
        )
        r["naive_extra"] = ne
        r["prediction_basis"] = (
            f"non-attention model FLOPs at {PRED_EFF:.0%} bf16 rate + full-rectangle attention "
            "in fp32 at the measured fp32 rate + materialized scores (48 B/elem) at HBM BW"
        )
    r["predicted_ms"] = 1e3 * pred
    remaining = deadline - time.monotonic()
    est = (args.warmup + args.iters) * 2 * pred + (
        c.get("compile_guess_s", 0) if device.type == "cuda" else 0
    )
    if kind == "naive" and device.type == "cuda":
        saved = (
            4 * r["naive_extra"]["score_elems"]
        )  # fp32 softmax outputs kept for backward, all K steps
        r["naive_saved_scores_gib"] = saved / 2**30
        if saved > torch.cuda.get_device_properties(device).total_memory:
            est = 15.0  # expected to OOM within the first step's forward: try it (cheap) and report
            r["expected"] = "oom"
    if remaining < max(5.0, est):
        r.update(status="skipped", reason=f"budget: {remaining:.0f} s left, needs ~{est:.0f} s")
        return r
    cuda = device.type == "cuda"
    s = None
    t_start = time.monotonic()
    try:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        s = build_benchmark(
            draft_config(m),
            batch_size=B,
            seq_len=T,
            steps=K,
            device=str(device),
            dtype=args.dtype,
            attention=c["attention"],
            compile=c["compile"],
            compile_mode=c["compile_mode"],
            target_argmax=not args.argmax_in_step,
        )
        if world > 1:
            from eagle3.train.parallel import wrap

            ddp = wrap(TTTModule(s.model), args.dist, fsdp=args.fsdp)
            if (
                args.fsdp
            ):  # FSDP2: parameters are now sharded DTensors; the optimizer must hold those
                s.optimizer = torch.optim.AdamW(
                    [p for p in s.model.parameters() if p.requires_grad],
                    lr=1e-4,
                    betas=(0.9, 0.95),
                    foreach=True,
                )
                c = dict(c, name=c["name"].replace("DDP", "FSDP2"))
                r["name"], r["parallel"] = c["name"], "fsdp2"
            step = lambda: ddp_step(s, ddp)  # noqa: E731
        else:
            step = (lambda: naive_step(s)) if kind == "naive" else (lambda: run_benchmark_step(s))
        before = compile_counters()
        t0 = time.monotonic()
        out = step()
        sync(device)
        r["first_step_s"] = round(time.monotonic() - t0, 3)  # includes compilation
        diff = {k: round(v - before.get(k, 0), 2) for k, v in compile_counters().items()}
        r["first_step_compile"] = {
            k: v for k, v in diff.items() if v >= (0.5 if k.startswith("seconds.") else 1)
        }
        warm = []
        for _ in range(max(0, args.warmup - 1)):
            t0 = time.monotonic()
            out = step()
            sync(device)
            warm.append(time.monotonic() - t0)
        if cuda and args.warmup > 0:
            sites = host_sync_sites(step, device) if world == 1 else None
            r["host_syncs_per_step"] = None if sites is None else len(sites)
            r["host_sync_sites"] = sites
            sync(device)
        per = min(warm) if warm else r["first_step_s"]
        left = deadline - time.monotonic() - 3.0
        n = max(1, min(args.iters, int(left / max(per, 1e-4))))
        clk = Clock(device)
        marks = [clk.mark()]
        for _ in range(n):
            out = step()
            marks.append(clk.mark())
        ms = clk.elapsed_ms(marks)  # the only host sync of the timed loop
        med = statistics.median(ms)
        r.update(
            status="ok",
            timed_steps=n,
            ms_per_step=med,
            ms_min=min(ms),
            ms_max=max(ms),
            tokens_per_s=tokens / (med / 1e3),
            loss=float(out.loss.detach()),
        )
        achieved = model_flops / (med / 1e3)
        r["achieved_model_flops_per_s"] = achieved
        r["mfu"] = achieved / (rates["bf16_matmul_flops"] * world)
        if rates.get("spec_bf16_flops"):
            r["mfu_vs_spec_peak"] = achieved / rates["spec_bf16_flops"]
        r["outcome_over_prediction"] = med / r["predicted_ms"]
        r["outcome_over_floor"] = med / r["floor_ms"]
        if cuda:
            r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if c.get("profile") and cuda and deadline - time.monotonic() > 20 * med / 1e3 + 10:
            r["profile"] = profile_steps(step, device, args.out_dir, c["name"])
    except torch.OutOfMemoryError as e:
        r.update(status="oom", reason=str(e).splitlines()[0][:300])
    except Exception as e:  # a failed config is reported, the run goes on
        r.update(status="error", reason=f"{type(e).__name__}: {str(e)[:500]}")
    finally:
        if cuda and r.get("status") in ("oom", "error"):
            r["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        r["wall_s"] = round(time.monotonic() - t_start, 2)
        s = out = step = ddp = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return r


# ------------------------------------------------------------------------------------ compile cache


def compile_counters() -> dict:
    """torch.compile's cache counters (FX graph cache and AOT autograd cache hits/misses, graphs
    compiled) and dynamo's cumulative compile seconds per phase: what the first step spent and
    whether a loaded cache was used."""
    from torch._dynamo.utils import counters

    out = {
        f"{group}.{k}": v
        for group in ("inductor", "aot_autograd")
        for k, v in counters[group].items()
        if "cache" in k or k in ("ok", "total")
    }
    try:
        from torch._dynamo.utils import compilation_time_metrics

        out.update({f"seconds.{k}": round(sum(v), 2) for k, v in compilation_time_metrics.items()})
    except ImportError:  # moved in some torch versions: the counters alone still say hit or miss
        pass
    return out


def load_compile_cache(path: Path) -> dict:
    """torch.compiler.load_cache_artifacts(FILE) when FILE exists (what a second machine does with
    the first one's file; eagle3.train.trainer.load_compile_cache in the trainer); returns what
    happened, for the results."""
    if not path.is_file():
        return {
            "path": str(path),
            "loaded": False,
            "reason": "no file yet (this process will write it)",
        }
    t0 = time.monotonic()
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as e:  # only a speed-up: compile from scratch and say so
        return {"path": str(path), "loaded": False, "reason": f"{type(e).__name__}: {str(e)[:300]}"}
    if info is None:
        return {
            "path": str(path),
            "loaded": False,
            "reason": "unreadable (corrupt, or another torch wrote it)",
        }
    return {
        "path": str(path),
        "loaded": True,
        "bytes": path.stat().st_size,
        "load_s": round(time.monotonic() - t0, 2),
        "artifacts": {str(k): len(v) for k, v in info.artifacts.items()},
    }


def save_compile_cache(path: Path) -> dict:
    """Every torch.compile artifact of this process so far -> FILE (temp name, then rename)."""
    t0 = time.monotonic()
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return {
            "path": str(path),
            "bytes": 0,
            "reason": "torch.compiler.save_cache_artifacts returned nothing",
        }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(saved[0])
    os.replace(tmp, path)
    return {"path": str(path), "bytes": len(saved[0]), "save_s": round(time.monotonic() - t0, 2)}


# ------------------------------------------------------------------------------------------- output


def write_results(res: dict, out_dir: Path) -> None:
    write_result(out_dir / "train_step", res, markdown(res))


def markdown(res: dict) -> str:
    L = [f"# EAGLE-3 TTT train step — {res['machine'].get('gpu') or res['machine']['device']}", ""]
    L.append(
        f"{res['date']} · torch {res['machine']['torch']} · `{res['command']}`"
        + (" · **partial** (" + res["partial"] + ")" if res.get("partial") else "")
    )
    L.append("")
    h = res.get("headline")
    rates = res.get("rates", {})
    if h:
        L += [
            f"**Floors, {h['name']}** ({h['tokens_per_step']} tokens/step):",
            f"- FLOPs: {h['model_flops_per_step'] / 1e12:.1f} TFLOP/step "
            f"({h['model_flops_per_token'] / 1e9:.2f} GFLOP/token) / measured bf16 matmul "
            f"{rates.get('bf16_matmul_flops', 0) / 1e12:.0f} TFLOP/s → "
            f"**{h['compute_floor_ms']:.1f} ms**",
            f"- Bytes: {h['bytes_per_step'] / 1e9:.1f} GB/step (weights + grads + AdamW state) / "
            f"measured HBM {rates.get('hbm_bytes_per_s', 0) / 1e12:.2f} TB/s → "
            f"**{h['bytes_floor_ms']:.1f} ms**",
            f"- floor = max = {max(h['compute_floor_ms'], h['bytes_floor_ms']):.1f} ms "
            "= "
            f"{h['tokens_per_step'] / max(h['compute_floor_ms'], h['bytes_floor_ms']):.1f}k "
            "tokens/s",
            "",
        ]
    L += [
        "| config | kind | B×T | K | attention | compile | ms/step (median) | tokens/s | MFU | "
        "peak GiB | floor ms | predicted ms | outcome/pred | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res.get("configs", []):
        L.append(
            f"| {r['name']}{' (' + r['ran_on'] + ')' if r.get('ran_on') else ''} | {r['kind']} | "
            f"{r['batch']}×{r['seq']} | {r['K']} | {r['attention']} | "
            f"{'yes' if r['compile'] else 'no'} | {fmt(r.get('ms_per_step'))} | "
            f"{fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{fmt(100 * r['mfu'] if 'mfu' in r else None)}{'%' if 'mfu' in r else ''} | "
            f"{fmt(r.get('peak_mem_gib'))} | {fmt(r.get('floor_ms'))} | "
            f"{fmt(r.get('predicted_ms'))} | {fmt(r.get('outcome_over_prediction'), ',.2f')} | "
            f"{r.get('status', '?')}{(': ' + r['reason'][:80]) if r.get('reason') else ''} |"
        )
    ds = res.get("ddp_scaling")
    if ds:
        L += [
            "",
            "DDP scaling (tokens/s over all GPUs ÷ the same per-GPU config on one GPU): "
            + ", ".join(f"{k}: {v:.2f}×" for k, v in ds.items()),
        ]
    sp = res.get("speedups")
    if sp:
        L += [
            "",
            "Fast vs naive (same seq/K): " + ", ".join(f"{k}: {v:.2f}×" for k, v in sp.items()),
        ]
    n = res.get("numerics")
    if n:
        if "error" in n or "skipped" in n:
            L += ["", f"Numerics check: {n.get('error') or 'skipped, ' + n['skipped']}"]
        else:
            L += [
                "",
                f"Numerics ({n['fast_attention']} vs naive, B={n['B']} T={n['T']} K={n['K']}): "
                f"**{'pass' if n['pass'] else 'FAIL'}** — bf16 fast vs fp32 ref: loss rel "
                f"{n['bf16_fast_vs_ref']['loss_rel']:.2e}, grad rel "
                f"{n['bf16_fast_vs_ref']['grad_rel_max']:.2e} (naive bf16: "
                f"{n['bf16_naive_vs_ref']['loss_rel']:.2e}, "
                f"{n['bf16_naive_vs_ref']['grad_rel_max']:.2e}); fp32 fast vs ref: "
                f"{n['fp32_fast_vs_ref']['loss_rel']:.2e}, "
                f"{n['fp32_fast_vs_ref']['grad_rel_max']:.2e}"
                + (
                    f" ({n['run']['date']}, `{n['run']['command']}`: {n['run']['note']})"
                    if n.get("run")
                    else ""
                ),
            ]
    fm = res.get("flop_model_headline")
    if fm:
        L += ["", f"FLOP model per token ({h['name'] if h else ''}; {fm['convention']}):", ""]
        L += [f"- {k}: {v / 1e6:,.1f} MFLOP fwd" for k, v in fm["forward_per_token"].items()]
        L += [
            f"- trainable fwd+bwd: {fm['trainable_fwd_bwd_per_token'] / 1e9:.3f} GFLOP; target "
            f"head (draft vocab, fwd): {fm['target_lm_head_restricted_per_token'] / 1e9:.3f} GFLOP "
            f"→ model total **{fm['model_flops_per_token'] / 1e9:.3f} GFLOP/token**; with the "
            "unrestricted target head "
            f"{fm['model_flops_per_token_unrestricted_target'] / 1e9:.3f}; executed incl. "
            f"full-vocab argmax {fm['executed_flops_per_token_incl_full_vocab_argmax'] / 1e9:.3f}"
        ]
    for r in res.get("configs", []):
        pr = r.get("profile")
        if isinstance(
            pr, dict
        ):  # True = asked for; a dict once torch.profiler ran (CUDA, budget left)
            L += [
                "",
                f"Profile of {r['name']} (torch.profiler, {pr['steps']} steps): GPU busy "
                f"{pr['gpu_ms_per_step']:.1f} ms/step of {r['ms_per_step']:.1f} ms wall",
                "",
                "| kernel group | ms/step |",
                "|---|---|",
            ]
            L += [f"| {g} | {v:.1f} |" for g, v in pr["groups_ms_per_step"].items()]
    return "\n".join(L) + "\n"


def finalize(res: dict) -> None:
    ok = {
        (r["seq"], r["K"], r["batch"], r["kind"]): r
        for r in res["configs"]
        if r.get("status") == "ok" and r.get("world", 1) == 1
    }
    res["speedups"] = {
        f"B{b}xT{T}/K{K}": ok[(T, K, b, "naive")]["ms_per_step"]
        / ok[(T, K, b, "fast")]["ms_per_step"]
        for (T, K, b, kind) in ok
        if kind == "naive" and (T, K, b, "fast") in ok
    }


def merge_results(dirs: list[Path], out_dir: Path) -> int:
    """One train_step.{json,md} from several processes' results (e.g. GPU0, GPU1, DDP on both):
    configs concatenated in order, rates/floors/profile/numerics from the first, DDP scaling vs the
    matching 1-GPU row."""
    missing = [str(d) for d in dirs if not (d / "train_step.json").exists()]
    if missing:
        print(
            f"train_step --merge: no train_step.json in {missing} (that process wrote nothing); "
            "merging the rest",
            file=sys.stderr,
        )
    parts = [
        json.loads((d / "train_step.json").read_text())
        for d in dirs
        if (d / "train_step.json").exists()
    ]
    if not parts:
        raise SystemExit(
            f"train_step --merge: none of {[str(d) for d in dirs]} holds a train_step.json"
        )
    res = dict(parts[0])
    res["configs"] = [
        dict(r, ran_on=r.get("ran_on") or p["machine"].get("label"))
        for p in parts
        for r in p["configs"]
    ]
    res["merged_from"] = [
        {
            "command": p["command"],
            "label": p["machine"].get("label"),
            "world": p["machine"].get("world", 1),
            "rates": p.get("rates"),
            "partial": p.get("partial"),
            "wall_s": p.get("wall_s"),
        }
        for p in parts
    ]
    res["partial"] = (
        "; ".join(f"{p['machine'].get('label')}: {p['partial']}" for p in parts if p.get("partial"))
        or None
    )
    if res.get("numerics", {}).get("pass") is None:
        res["numerics"] = next(
            (p["numerics"] for p in parts if p.get("numerics", {}).get("pass") is not None),
            res.get("numerics"),
        )
    finalize(res)
    single = {
        (r["seq"], r["K"], r["batch"]): r
        for r in res["configs"]
        if r.get("status") == "ok" and r["kind"] == "fast" and r.get("world", 1) == 1
    }
    res["ddp_scaling"] = {
        r["name"]: r["tokens_per_s"] / single[(r["seq"], r["K"], r["batch"])]["tokens_per_s"]
        for r in res["configs"]
        if r.get("world", 1) > 1
        and r.get("status") == "ok"
        and (r["seq"], r["K"], r["batch"]) in single
    }
    write_results(res, out_dir)
    print(
        json.dumps(
            {
                "merged": [str(d) for d in dirs],
                "out": str(out_dir),
                "ddp_scaling": res["ddp_scaling"],
            }
        )
    )
    return 0


# --------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--budget-s", type=float, default=240.0, help="wall-clock budget of the whole run"
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="default benchmarks/results (temp dir with --smoke)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny dims, 1 step each, CPU unless --device"
    )
    p.add_argument("--device", default=None)
    p.add_argument(
        "--compile",
        choices=("auto", "on", "off"),
        default="auto",
        help="torch.compile the draft midlayer on the fast path: auto = at seq >= 8192 only (where "
        "it pays and the compile time is amortized), on = every fast config, off = never",
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="warm-up steps (first includes compilation)"
    )
    p.add_argument(
        "--iters",
        type=int,
        default=None,
        help="timed steps (median reported; shrunk to fit the budget)",
    )
    p.add_argument(
        "--fill-batch", type=int, default=2, help="extra K=7/8192 run at this batch (0 = none)"
    )
    p.add_argument("--skip-naive-8192", action="store_true")
    p.add_argument(
        "--profile",
        action="store_true",
        help="torch.profiler over 2 steps of the first config: GPU "
        "time by kernel group in the JSON, top kernels in train_step_profile.txt",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        metavar="KIND:K:SEQ[:BATCH]",
        default=None,
        help="run these instead of the default list, e.g. fast:7:8192 naive:7:2048 fast:7:8192:2 "
        "(to split the list over GPUs, one process each)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="with --ddp: FSDP2 (fully_shard per layer + root, "
        "eagle3.train.parallel.wrap(fsdp=True)) instead of DDP",
    )
    p.add_argument(
        "--ddp",
        action="store_true",
        help="under torchrun: the fast configs through DDP on every "
        "rank (eagle3.train.parallel), tokens/s over all ranks; rank 0 writes the results",
    )
    p.add_argument(
        "--flex-compile-mode",
        default=None,
        help="torch.compile mode of the flex attention kernel "
        "(eagle3.train.attention.FLEX_COMPILE_MODE), e.g. max-autotune-no-cudagraphs",
    )
    p.add_argument(
        "--no-split-diagonal",
        action="store_true",
        help="flex over all keys concatenated (padded to "
        "K*T, as before 2026-12-02) instead of the step-0 keys plus the merged diagonal "
        "(eagle3.train.attention.SPLIT_DIAGONAL)",
    )
    p.add_argument(
        "--argmax-in-step",
        action="store_true",
        help="the step computes the target's full-vocab argmax "
        "(the full-vocab head GEMM) instead of reading it from the batch, as streaming mode does",
    )
    p.add_argument(
        "--skip-numerics", action="store_true", help="leave the numerics check to another process"
    )
    p.add_argument(
        "--label", default=None, help="where this process ran (e.g. GPU0), kept with each config"
    )
    p.add_argument(
        "--compile-mode",
        choices=("layer", "split"),
        default="split",
        help="Eagle3Draft.compile_blocks mode: split = the blocks around the attention kernel "
        "compiled once for all TTT steps, layer = each decoder layer whole, recompiled per step",
    )
    p.add_argument(
        "--compile-guess-s",
        type=float,
        default=90.0,
        help="compile time a compiled config is assumed to add (budget planning only)",
    )
    p.add_argument(
        "--dims",
        choices=sorted(DIMS),
        default="llama-3.1-8b",
        help="draft dimensions of the real run (--smoke always uses tiny dims)",
    )
    p.add_argument(
        "--compile-cache",
        type=Path,
        default=None,
        metavar="FILE",
        help="torch.compiler cache artifacts: loaded before the first config when FILE exists, "
        "rewritten after every config that ran (the FILE format of the trainer's compile_cache; "
        "its directory format: TORCHINDUCTOR_CACHE_DIR/TRITON_CACHE_DIR, see gpu_step_vs_peer.sh "
        "--export-cache-dirs)",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="DIR",
        help="no run: combine DIR/train_step.json of several processes into --out-dir",
    )
    args = p.parse_args(argv)
    if args.merge:
        return merge_results(args.merge, args.out_dir or RESULTS)
    t_begin = time.monotonic()
    deadline = t_begin + args.budget_s - 4.0  # leave time to write the results
    attention.FLEX_COMPILE_MODE = args.flex_compile_mode
    attention.SPLIT_DIAGONAL = not args.no_split_diagonal
    args.dist = None
    if args.ddp:
        from eagle3.train.parallel import setup

        args.dist = setup(
            args.device or "cuda"
        )  # --device cpu: gloo (a CPU smoke test of this path)
        args.device = str(args.dist.device)
        if args.dist.rank != 0:
            args.out_dir = Path(tempfile.mkdtemp(prefix=f"train_step_rank{args.dist.rank}_"))
    device = torch.device(
        args.device or ("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    )
    cuda = device.type == "cuda"
    if args.smoke and not cuda:
        torch.set_num_threads(1)  # tiny ops: threads only contend (shared CI boxes)
    args.dtype = (
        torch.float32 if args.smoke and not cuda else torch.bfloat16
    )  # CPU bf16 matmuls crawl
    if args.warmup is None:
        args.warmup = 0 if args.smoke else 3
    if args.iters is None:
        args.iters = 1 if args.smoke else 10
    if args.out_dir is None:
        args.out_dir = Path(tempfile.mkdtemp(prefix="train_step_smoke_")) if args.smoke else RESULTS
    m = SMOKE if args.smoke else DIMS[args.dims]
    fast_att = "flex" if cuda else "sdpa"  # flex is forward-only on CPU
    big, mid, small = (64, 48, 32) if args.smoke else (8192, 4096, 2048)

    def comp(T):
        return cuda and (args.compile == "on" or (args.compile == "auto" and T >= big))

    def cfg(name, kind, T, K, B=1):
        c = dict(
            name=name,
            kind=kind,
            seq=T,
            K=K,
            batch=B,
            attention=fast_att if kind == "fast" else "naive",
            compile=comp(T) if kind == "fast" else False,
            compile_mode=args.compile_mode,
        )
        c["compile_guess_s"] = args.compile_guess_s if c["compile"] else 30
        if args.label:
            c["ran_on"] = args.label
        return c

    def parse(spec: str) -> dict:
        kind, K, T, *b = spec.split(":")
        if kind not in ("fast", "naive") or len(b) > 1:
            raise SystemExit(
                f"--configs {spec!r}: expected fast|naive:K:SEQ[:BATCH], e.g. fast:7:8192"
            )
        B = int(b[0]) if b else 1
        return cfg(f"{kind} K{K} {T}" + (f" batch {B}" if B > 1 else ""), kind, int(T), int(K), B)

    # priority order: what the budget drops first is last
    configs = [
        dict(cfg(f"fast K7 {big}", "fast", big, 7), profile=args.profile),
        cfg(f"naive K7 {small}", "naive", small, 7),
        cfg(f"fast K7 {small}", "fast", small, 7),
        cfg(f"fast K3 {big}", "fast", big, 3),
        cfg(f"fast K7 {mid}", "fast", mid, 7),
    ]
    if args.fill_batch > 1:
        configs.append(
            cfg(f"fast K7 {big} batch {args.fill_batch}", "fast", big, 7, args.fill_batch)
        )
    if not args.skip_naive_8192:
        configs.append(cfg(f"naive K7 {big}", "naive", big, 7))
    if args.configs:
        configs = [parse(x) for x in args.configs]
        configs[0]["profile"] = args.profile
    if args.dist:
        configs = [dict(c, profile=False) for c in configs if c["kind"] == "fast"]

    machine = {
        **describe_machine(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if cuda else None,
        "world": args.dist.world if args.dist else 1,
        "label": args.label,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    if cuda:
        machine["gpu_mem_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    res = {
        "date": utc_now(),
        "command": command_line(__file__, argv),
        "machine": machine,
        "smoke": args.smoke,
        "dims": m,
        "dims_name": f"smoke:{args.dims}" if args.smoke else args.dims,
        "budget_s": args.budget_s,
        "batch_note": "one packed row per step (batch 1, 2 documents/row) "
        "like the Speculators anchor, unless the config says batch > 1",
        "dtype": "bf16 autocast, fp32 master weights, fused AdamW (fp32 states)",
        "configs": [],
        "flop_model": {f"T{c['seq']}_K{c['K']}": flop_model(m, c["seq"], c["K"]) for c in configs},
        "bytes_model": {f"K{K}": bytes_model(m, K) for K in (3, 7)},
    }
    res["flop_model_headline"] = flop_model(m, big, 7)
    res["partial"] = "started"
    lock = threading.Lock()

    def save():
        with lock:
            write_results(res, args.out_dir)

    def watchdog():
        res["partial"] = "watchdog: budget exceeded while a config was running; results so far"
        try:
            save()
        finally:
            print(
                f"train_step: budget of {args.budget_s} s exceeded; wrote {args.out_dir}",
                file=sys.stderr,
                flush=True,
            )
            os._exit(3)

    timer = threading.Timer(args.budget_s, watchdog)
    timer.daemon = True
    timer.start()

    # 1. rates
    t0 = time.monotonic()
    if cuda:
        rates = {
            "bf16_matmul_flops": measure_matmul(device, 8192, torch.bfloat16),
            "fp32_matmul_flops": measure_matmul(device, 4096, torch.float32),
            "hbm_bytes_per_s": measure_bandwidth(device, 4 << 30),
            "method": "bf16: 8192^3 torch.matmul, fp32: 4096^3 "
            f"(allow_tf32={torch.backends.cuda.matmul.allow_tf32}), mean of 10 after 3 warm-up; "
            "HBM: 4 GiB bf16 copy_, 2x bytes (read+write), mean of 10",
        }
        spec = next((v for k, v in SPEC_BF16.items() if k in (machine["gpu"] or "")), None)
        if spec:
            rates["spec_bf16_flops"] = spec
    else:
        rates = {
            "bf16_matmul_flops": measure_matmul(device, 256, torch.bfloat16, iters=3, warmup=1),
            "fp32_matmul_flops": measure_matmul(device, 256, torch.float32, iters=3, warmup=1),
            "hbm_bytes_per_s": measure_bandwidth(device, 16 << 20, iters=3, warmup=1),
            "method": "CPU smoke: 256^3 matmul, 16 MiB copy",
        }
    rates["wall_s"] = round(time.monotonic() - t0, 2)
    res["rates"] = rates
    hm, hb = flop_model(m, big, 7), bytes_model(m, 7)
    res["headline"] = {
        "name": f"K=7, B1×{big}",
        "tokens_per_step": big,
        "model_flops_per_token": hm["model_flops_per_token"],
        "model_flops_per_step": hm["model_flops_per_token"] * big,
        "bytes_per_step": hb["bytes_per_step"],
        "compute_floor_ms": 1e3 * hm["model_flops_per_token"] * big / rates["bf16_matmul_flops"],
        "bytes_floor_ms": 1e3 * hb["bytes_per_step"] / rates["hbm_bytes_per_s"],
    }
    print(json.dumps({"rates": rates, "headline": res["headline"]}), flush=True)
    if args.compile_cache:
        res["compile_cache"] = load_compile_cache(args.compile_cache)
        print(json.dumps({"compile_cache": res["compile_cache"]}), flush=True)
    save()

    # 2. configs in priority order, the GPU numerics check after the first three (compiles are the
    #    slow part)
    def numerics():
        t0 = time.monotonic()
        if args.dist or args.skip_numerics:
            res["numerics"] = {"skipped": "left to another process of this run", "pass": None}
            return
        if cuda and deadline - t0 < 40:
            res["numerics"] = {"skipped": f"budget: {deadline - t0:.0f} s left", "pass": None}
            return
        try:
            res["numerics"] = numerics_check(device, fast_att, T=16 if args.smoke else 256)
        except Exception as e:
            res["numerics"] = {"error": f"{type(e).__name__}: {str(e)[:500]}", "pass": False}
        res["numerics"]["wall_s"] = round(time.monotonic() - t0, 2)
        print(json.dumps({"numerics": res["numerics"]}, default=str), flush=True)
        save()

    for i, c in enumerate(configs):
        if i == min(3, len(configs)):
            numerics()
        r = run_config(c, m, device, args, deadline, rates)
        if r.get("status") == "error" and c["kind"] == "fast" and attention.SPLIT_DIAGONAL:
            # the split flex attention (step-0 keys + merged diagonal) is new (2026-12-02): one
            # failure sends this and later configs back to the padded keys of 2026-12-01, and says
            # so in the row
            print(json.dumps({"split_diagonal_failed": r.get("reason")}), flush=True)
            attention.SPLIT_DIAGONAL = False
            r = dict(
                run_config(c, m, device, args, deadline, rates),
                split_diagonal_error=r.get("reason"),
                fallback="flex split diagonal off (padded keys)",
            )
        if (
            r.get("status") == "error"
            and c["kind"] == "fast"
            and (c["compile_mode"] == "split" or attention.PAD_KEYS)
        ):
            # the split compile and the padded flex keys are new (2026-12-01): one failure sends
            # this and later configs to the old layer compile and per-step key lengths, and says so
            # in the row
            print(json.dumps({"split_compile_failed": r.get("reason")}), flush=True)
            args.compile_mode, attention.PAD_KEYS = "layer", False
            for later in configs[i:]:
                later["compile_mode"] = "layer"
            r = dict(
                run_config(c, m, device, args, deadline, rates),
                split_compile_error=r.get("reason"),
                fallback="compile_mode=layer, padded flex keys off",
            )
        if c["kind"] == "fast" and c["attention"] == "flex":
            r["flex_split_diagonal"] = attention.SPLIT_DIAGONAL
        res["configs"].append(r)
        finalize(res)
        print(
            json.dumps({k: v for k, v in r.items() if k != "naive_extra"}, default=str), flush=True
        )
        if args.compile_cache and r.get("status") == "ok" and r.get("compile"):
            res.setdefault("compile_cache", {})["saved"] = save_compile_cache(args.compile_cache)
        save()
    if "numerics" not in res:
        numerics()
    if (
        cuda
        and fast_att == "flex"
        and res["numerics"].get("pass") is not None
        and deadline - time.monotonic() > 30
    ):
        try:  # the attention kernel alone (fp32), step_setup.check_flex
            res["numerics"]["attention_only_fp32_check"] = check_flex(str(device))
        except Exception as e:
            res["numerics"]["attention_only_fp32_check"] = {
                "error": f"{type(e).__name__}: {str(e)[:300]}"
            }

    timer.cancel()
    res["partial"] = None
    res["wall_s"] = round(time.monotonic() - t_begin, 1)
    with lock:
        write_results(res, args.out_dir)
    print(
        f"wrote {args.out_dir / 'train_step.json'} and train_step.md ({res['wall_s']} s)",
        flush=True,
    )
    if args.dist:
        from eagle3.train.parallel import teardown

        teardown(args.dist)
    bad = [r["name"] for r in res["configs"] if r.get("status") == "error"]
    return 1 if (bad or res["numerics"].get("pass") is False) else 0


if __name__ == "__main__":
    sys.exit(main())
