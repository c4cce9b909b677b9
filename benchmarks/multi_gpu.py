#!/usr/bin/env python3
"""Scaling over several GPUs: the train step under torchrun (DDP, FSDP2) and one capture over N
engines.

    # train: Kimi-K2.5 and Llama-8B draft dims, K = 7, T = 8192, on 1/2/4/8 GPUs (those the host
    # has), DDP + FSDP2
    python3 benchmarks/multi_gpu.py train [--num-gpus 1 2 4 8] [--dims kimi-k2.5 llama-3.1-8b] \
        [--parallel ddp fsdp2]
    # capture: the prepared data captured once per engine count (each engine:
    # tensor_parallel_size GPUs)
    python3 benchmarks/multi_gpu.py capture --target DIR --data PREPARED [--num-engines 1 2 4 8] \
        [--backend vllm]
    # the CPU proof of both (tiny dims, a tiny random target; 1 and 2 processes), rows labelled
    # dims cpu-tiny:
    python3 benchmarks/multi_gpu.py train --smoke && python3 benchmarks/multi_gpu.py capture --smoke

train runs benchmarks/train_step.py under `torchrun --nproc-per-node N` (its --ddp path: the draft
wrapped by eagle3.train.parallel.wrap, DDP or FSDP2 `--fsdp`, one packed row of T tokens per GPU per
step, bf16 autocast, fp32 AdamW, torch.compile'd at T >= 8192 on the GPU). One process is the
baseline of both wrappings (no wrapping). capture runs `eagle3 capture --num-engines N`
(eagle3.capture.engines) into a fresh directory per N; tokens/s is every engine's tokens over the
slowest engine's capture time (engine start-up excluded; `wall_s` includes it).

Rows are merged into benchmarks/results/multi_gpu.{json,md} (--out-dir), replacing earlier rows with
the same what / dims / parallel / num_gpus / gpu:
    {"what": "train", "dims", "parallel": "ddp"|"fsdp2", "num_gpus", "tok_s", "efficiency",
     "peak_gib", "gpu", "date"}
    {"what": "capture", "dims": <target>, "parallel": "engines", "num_gpus", "num_engines", "tok_s",
     "efficiency", ...}
efficiency = tok_s(N) / (N / N0 x tok_s(N0)), N0 the smallest count measured in the same call (1 by
default): weak scaling, every GPU (engine) does the same work as the single one. Goals
(docs/scaling.md): train >= 0.90 at the largest N (DDP, Kimi-K2.5 dims), FSDP2 within 10 % of DDP,
capture over N engines >= 0.9 x N x one engine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, fmt, utc_now, write_result

ROOT = Path(__file__).resolve().parents[1]
TRAIN_STEP = ROOT / "benchmarks" / "train_step.py"
KEY = ("what", "dims", "parallel", "num_gpus", "gpu")


def child_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


def count_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # no torch/CUDA: no GPU
        return 0


def add_efficiency(rows: list[dict], group: tuple[str, ...]) -> None:
    """efficiency of each ok row against the smallest num_gpus of its group (same dims, and for
    capture the same engine size): tok_s / (N / N0 x tok_s(N0))."""
    base: dict[tuple, dict] = {}
    for r in sorted((r for r in rows if r.get("tok_s")), key=lambda r: r["num_gpus"]):
        base.setdefault(tuple(r.get(k) for k in group), r)
    for r in rows:
        b = base.get(tuple(r.get(k) for k in group))
        if r.get("tok_s") and b:
            r["efficiency"] = round(r["tok_s"] / (r["num_gpus"] / b["num_gpus"] * b["tok_s"]), 4)
            r["baseline_num_gpus"] = b["num_gpus"]


# -------------------------------------------------------------------------------------------- train


def train_step_run(n: int, dims: str, fsdp: bool, args, work: Path) -> dict:
    """One torchrun launch of train_step.py on n processes; its (only) config row, with the
    machine's GPU name."""
    out = work / f"train-{dims}-{'fsdp2' if fsdp else 'ddp'}-{n}"
    seq = 64 if args.smoke else args.seq
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(n),
        str(TRAIN_STEP),
        "--ddp",
        "--configs",
        f"fast:{args.ttt_steps}:{seq}",
        "--dims",
        dims,
        "--skip-numerics",
        "--budget-s",
        str(args.budget_s),
        "--out-dir",
        str(out),
        "--label",
        f"{n}x",
    ]
    if fsdp:
        cmd.append("--fsdp")
    if args.smoke:
        cmd += ["--smoke", "--device", "cpu"]
    print(f"multi_gpu: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    env = child_env()
    if args.smoke:
        env["OMP_NUM_THREADS"] = "1"
    t0 = time.monotonic()
    p = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.budget_s + 180
    )
    wall = round(time.monotonic() - t0, 1)
    try:
        res = json.loads((out / "train_step.json").read_text())
        row = res["configs"][0]
    except (OSError, ValueError, IndexError, KeyError):
        return {
            "status": "error",
            "reason": f"exit {p.returncode}: {p.stderr[-1500:]}",
            "wall_s": wall,
        }
    return {
        **row,
        "gpu": res["machine"].get("gpu") or "cpu",
        "wall_s": wall,
        "exit_code": p.returncode,
    }


def train_rows(args, work: Path) -> list[dict]:
    rows = []
    counts = sorted(set(args.num_gpus))
    for dims in args.dims:
        one = None
        for n in counts:
            for parallel in args.parallel:
                if n == 1 and one is not None:  # one process: no wrapping, the same run for both
                    got = one
                else:
                    got = train_step_run(n, dims, parallel == "fsdp2" and n > 1, args, work)
                    one = got if n == 1 else one
                status = got.get("status")
                rows.append(
                    {
                        "what": "train",
                        "dims": "cpu-tiny" if args.smoke else dims,
                        "parallel": parallel,
                        "num_gpus": n,
                        "tok_s": round(got["tokens_per_s"], 1) if status == "ok" else None,
                        "efficiency": None,
                        "peak_gib": round(got["peak_mem_gib"], 2)
                        if got.get("peak_mem_gib") is not None
                        else None,
                        "gpu": got.get("gpu", "cpu" if args.smoke else None),
                        "date": utc_now(),
                        "status": status,
                        "reason": got.get("reason"),
                        "ms_per_step": got.get("ms_per_step"),
                        "tokens_per_step": got.get("tokens_per_step"),
                        "mfu": got.get("mfu"),
                        "first_step_s": got.get("first_step_s"),
                        "ttt_steps": args.ttt_steps,
                        "seq": 64 if args.smoke else args.seq,
                        "wall_s": got.get("wall_s"),
                        "note": (
                            "CPU, tiny dims (train_step.py --smoke), gloo: proves the tool, not a "
                            "GPU figure"
                            if args.smoke
                            else "one process: no wrapping"
                            if n == 1
                            else None
                        ),
                    }
                )
    add_efficiency(rows, ("what", "dims", "gpu"))
    return rows


# ------------------------------------------------------------------------------------------ capture


def tiny_capture_inputs(work: Path) -> tuple[Path, Path]:
    """A tiny random Llama and a prepared dataset of its tiny conversations (eagle3 prepare), for
    --smoke."""
    from eagle3.testing.tiny import TinySpec, build_tiny_target, tiny_conversations

    target = build_tiny_target(work / "tiny-target", TinySpec(arch="llama", num_layers=5))
    chats = work / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps({"messages": c["messages"]}) + "\n"
            for c in tiny_conversations(160, seed=0, max_turns=4)
        )
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "eagle3.cli",
            "prepare",
            "--target",
            str(target),
            "--data",
            str(chats),
            "--out",
            str(work / "prepared"),
            "--max-seq-len",
            "256",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if p.returncode != 0:
        raise SystemExit(f"multi_gpu: eagle3 prepare failed: {p.stderr[-2000:]}")
    return target, work / "prepared"


def last_json(stdout: str) -> dict:
    """The result JSON the eagle3 CLI prints last (vLLM may log to stdout before it)."""
    lines = stdout.splitlines()
    start = max(i for i, line in enumerate(lines) if line == "{")
    return json.loads("\n".join(lines[start:]))


def capture_run(n: int, args, target: Path, data: Path, work: Path) -> dict:
    out = work / f"capture-{n}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "eagle3.cli",
        "capture",
        "--target",
        str(target),
        "--data",
        str(data),
        "--out",
        str(out),
        "--backend",
        args.backend,
        "--num-engines",
        str(n),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
        "--batch-tokens",
        str(args.batch_tokens),
        "--shard-tokens",
        str(args.shard_tokens),
        "--storage-dtype",
        args.storage_dtype,
        "--writer",
        args.writer,
    ]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    if args.backend == "hf":
        cmd += ["--device", "cpu" if args.smoke else "auto"]
    print(f"multi_gpu: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    p = subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=args.budget_s
    )
    wall = round(time.monotonic() - t0, 1)
    if p.returncode != 0:
        return {
            "status": "error",
            "reason": f"exit {p.returncode}: {p.stderr[-1500:]}",
            "wall_s": wall,
        }
    res = last_json(p.stdout)
    shutil.rmtree(out, ignore_errors=True)  # the states themselves are not needed
    return {"status": "ok", "result": res, "wall_s": wall}


def capture_rows(args, work: Path) -> list[dict]:
    if args.smoke:
        target, data = tiny_capture_inputs(work)
    else:
        if not args.target or not args.data:
            raise SystemExit(
                "multi_gpu capture: --target and --data (a prepared dataset) are needed (or "
                "--smoke)"
            )
        target, data = Path(args.target), Path(args.data)
    gpus = count_gpus()
    per = args.tensor_parallel_size if args.backend == "vllm" else 1
    rows = []
    for n in sorted(set(args.num_engines)):
        got = capture_run(n, args, target, data, work)
        res = got.get("result") or {}
        info = (res.get("extra") or {}).get("backend_info") or {}
        rows.append(
            {
                "what": "capture",
                "dims": "cpu-tiny" if args.smoke else Path(target).name,
                "parallel": "engines",
                "num_gpus": n * per if gpus else n,
                "num_engines": n,
                "tensor_parallel_size": per,
                "tok_s": res.get("tokens_per_s") or None,
                "efficiency": None,
                "peak_gib": None,
                "gpu": gpu_name() if gpus else "cpu",
                "date": utc_now(),
                "status": got["status"],
                "reason": got.get("reason"),
                "backend": args.backend,
                "num_tokens": res.get("num_tokens"),
                "capture_s": res.get("capture_s"),
                "wall_s": got["wall_s"],
                "engines": info.get("engines"),
                "note": (
                    "CPU, tiny random target, hf backend: proves the tool, not a GPU figure"
                    if args.smoke
                    else None
                ),
            }
        )
    add_efficiency(rows, ("what", "dims", "gpu", "tensor_parallel_size"))
    return rows


def gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:
        return None


# ------------------------------------------------------------------------------------------ results


def merge(path: Path, new: list[dict]) -> list[dict]:
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    keys = {tuple(r.get(k) for k in KEY) for r in new}
    return [r for r in old if tuple(r.get(k) for k in KEY) not in keys] + new


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Multi-GPU scaling: train step (DDP / FSDP2) and capture over N engines",
        "",
        "Written by `benchmarks/multi_gpu.py` (its docstring: what runs, how efficiency is "
        "defined). Rows on `cpu` with dims `cpu-tiny` prove the tool on the CPU (gloo, tiny dims); "
        "they are not GPU figures.",
        "",
        "| what | dims | parallel | GPUs | engines | tokens/s | efficiency | peak GiB | GPU | "
        "status | date |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(
        rows,
        key=lambda r: (
            r["what"] != "train",
            r["gpu"] == "cpu",
            r["dims"],
            r["parallel"],
            r["num_gpus"],
        ),
    ):
        lines.append(
            f"| {r['what']} | {r['dims']} | {r['parallel']} | {r['num_gpus']} | "
            f"{r.get('num_engines', '–')} | {fmt(r.get('tok_s'), ',.0f')} | "
            f"{fmt(r.get('efficiency'), '.3f')} | {fmt(r.get('peak_gib'), '.1f')} | {r.get('gpu')} "
            f"| {r.get('status')} | {r['date'][:10]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    ap.add_argument("mode", choices=("train", "capture"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="the CPU proof: tiny dims / tiny target, 1 and 2 processes",
    )
    ap.add_argument(
        "--out-dir", type=Path, default=RESULTS, help="where multi_gpu.{json,md} are merged"
    )
    ap.add_argument(
        "--budget-s", type=int, default=None, help="per launch (train: train_step.py's budget)"
    )
    ap.add_argument(
        "--num-gpus",
        type=int,
        nargs="+",
        default=None,
        help="train: process counts (default 1 2 4 8, those the host has)",
    )
    ap.add_argument("--dims", nargs="+", default=["kimi-k2.5", "llama-3.1-8b"])
    ap.add_argument("--parallel", nargs="+", choices=("ddp", "fsdp2"), default=["ddp", "fsdp2"])
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--target", help="capture: the target model dir")
    ap.add_argument("--data", help="capture: a prepared dataset (eagle3 prepare)")
    ap.add_argument(
        "--num-engines",
        type=int,
        nargs="+",
        default=None,
        help="capture: engine counts (default 1 2 4 8 within the GPUs, 1 2 with --smoke)",
    )
    ap.add_argument(
        "--backend",
        choices=("vllm", "hf"),
        default=None,
        help="capture backend (default vllm; hf with --smoke)",
    )
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--shard-tokens", type=int, default=262144)
    ap.add_argument("--storage-dtype", default="bfloat16")
    ap.add_argument("--writer", choices=("driver", "worker"), default="driver")
    ap.add_argument("--limit", type=int, default=None, help="capture at most this many samples")
    ap.add_argument(
        "--keep-work",
        type=Path,
        default=None,
        help="work dir to keep (default: a temp dir, removed)",
    )
    args = ap.parse_args(argv)
    gpus = count_gpus()
    if args.mode == "train":
        if args.smoke:  # tiny dims whatever --dims names: one run, not one per name
            args.dims = args.dims[:1]
        args.budget_s = args.budget_s or (120 if args.smoke else 420)
        args.num_gpus = args.num_gpus or (
            [1, 2] if args.smoke else [n for n in (1, 2, 4, 8) if n <= max(gpus, 1)]
        )
    else:
        args.backend = args.backend or ("hf" if args.smoke else "vllm")
        args.budget_s = args.budget_s or (300 if args.smoke else 3600)
        per = args.tensor_parallel_size if args.backend == "vllm" else 1
        args.num_engines = args.num_engines or (
            [1, 2] if args.smoke else [n for n in (1, 2, 4, 8) if n * per <= gpus]
        )
        if args.smoke:
            args.batch_tokens, args.shard_tokens = (
                min(args.batch_tokens, 512),
                min(args.shard_tokens, 2048),
            )
    work = args.keep_work or Path(tempfile.mkdtemp(prefix="multi_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        rows = train_rows(args, work) if args.mode == "train" else capture_rows(args, work)
    finally:
        if args.keep_work is None:
            shutil.rmtree(work, ignore_errors=True)
    allrows = merge(args.out_dir / "multi_gpu.json", rows)
    payload = {"command": command_line(__file__, argv), "rows": allrows}
    write_result(args.out_dir / "multi_gpu", payload, markdown(allrows))
    for r in rows:
        print(
            json.dumps(
                {
                    k: r.get(k)
                    for k in (*KEY, "num_engines", "tok_s", "efficiency", "peak_gib", "status")
                }
            )
        )
    print(f"wrote {args.out_dir}/multi_gpu.{{json,md}}", file=sys.stderr)
    return 0 if all(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
