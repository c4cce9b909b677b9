#!/usr/bin/env python3
"""How many bytes/s of hidden states the capture's driver path carries, at Kimi-K2.5's width.

    python benchmarks/capture_rpc_bandwidth.py [--tokens-per-round 8192] [--rounds 3] \
        [--storage-dtype bfloat16]

The path under test is the one eagle3.capture.vllm_backend uses: the worker extension
(eagle3.vllm_ext) buffers the states of every prefill step,
`llm.collective_rpc("eagle3_capture_pop")` assembles and encodes them in the worker (msgpack bytes),
vLLM carries them to the driver, the driver decodes them (zero-copy view) and writes safetensors
shards with a running sha256 (eagle3.shards.save_safetensors_hashed).

Target: a random wide tiny Llama (eagle3.testing.tiny, hidden 7168 like Kimi-K2.5, 2 layers, 8 heads
of 128, MLP 64 wide, 512 tokens): per token it carries 4 states x 7168 (3 aux + last) = 57,344 bytes
in bf16, the user's size; its compute is small so the prefill is not the only thing measured. Layers
[1, 1, 1] + last (a 2-layer model has one distinct aux layer; the copies are made in the worker's
stack like distinct ones). Prompts: random token ids, `--prompt-tokens` each, one generate() per
round (as VLLMBackend.capture: generate, then one pop).

Then the same rounds with the worker writer (capture.writer = worker): meta (assemble + metadata
back) and write_shard (the worker writes + hashes the shard) s. Per driver round: generate (prefill
+ recording) s, pop (collective_rpc: assemble + encode in the worker, transfer, msgpack decode) s,
  decode_states s, shard write (save_safetensors_hashed to --workdir) s, and bytes. Reported:
bytes/s of pop alone, of pop + decode + write (the driver's whole share), and of the shard write
alone (what writing shards in the worker would leave: write + hash, no encode / transfer / decode),
compared with the rate that 8 GPUs' prefill needs (`eagle3 plan` for configs/kimi-k2.5.yaml,
tokens/s x 57,344). Writes benchmarks/results/capture_rpc_bandwidth.{json,md}. Needs vLLM (CPU build
is fine): TP = 1 here, so the worker runs inside vLLM's engine-core process and the pop crosses one
process boundary (engine core -> driver); with TP = 8 on GPUs it crosses two (worker -> engine core
-> driver).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, describe_machine, machine_line, utc_now, write_result

ROOT = Path(__file__).resolve().parents[1]
#: bytes/token of Kimi-K2.5's states: (3 aux + last) x hidden 7168 x 2 (bf16)
KIMI_STATE_BYTES = 4 * 7168 * 2


def plan_rates() -> dict:
    """Capture tokens/s on 8 GPUs per hardware profile, from eagle3.plan (the same numbers `eagle3
    plan` prints)."""
    import subprocess

    out = {}
    for hw in ("rtx-pro-6000", "h200", "b300"):
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "eagle3.cli",
                "plan",
                "--config",
                str(ROOT / "configs/kimi-k2.5.yaml"),
                "--target-config",
                str(ROOT / "configs/targets/kimi-k2.5.json"),
                "--hardware",
                hw,
                "--num-gpus",
                "8",
                "--num-samples",
                "100000",
                "--mean-tokens",
                "2000",
                "--format",
                "json",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
        )
        if p.returncode != 0:
            out[hw] = {"error": p.stderr[-500:]}
            continue
        d = json.loads(p.stdout)
        tps = d["capture"]["tokens_per_s"]
        out[hw] = {
            "capture_tokens_per_s": tps,
            "state_bytes_per_token": d["storage"]["state_bytes_per_token"],
            "needed_bytes_per_s": tps * d["storage"]["state_bytes_per_token"],
        }
    return out


def calibrate(nbytes: int) -> dict:
    """Single-thread rates of the primitives the path is made of, on this box: a memory copy (torch
    clone, 1 thread), bytes(numpy) (what encode_states does), sha256 (what the shard writer does
    while writing) — so the measured pop can be expressed in copies, and extrapolated to another CPU
    by its copy rate."""
    import hashlib

    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    out = {}
    for name, fn in (
        ("memcpy", lambda: x.clone()),
        ("tobytes", lambda: x.view(torch.uint8).numpy().tobytes()),
        ("sha256", lambda: hashlib.sha256(memoryview(x.view(torch.uint8).numpy())).digest()),
    ):
        fn()
        t = time.perf_counter()
        fn()
        out[f"{name}_bytes_per_s"] = nbytes / (time.perf_counter() - t)
    torch.set_num_threads(n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens-per-round", type=int, default=8192)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--storage-dtype", default="bfloat16")
    ap.add_argument(
        "--dtype", default="float32", help="engine dtype (bf16 is emulated and slow on this CPU)"
    )
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument(
        "--workdir", default=None, help="target + shards (default: a temp dir, removed at the end)"
    )
    ap.add_argument("--out", default=str(RESULTS / "capture_rpc_bandwidth"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    machine = describe_machine()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="caprpc."))
    work.mkdir(parents=True, exist_ok=True)

    import numpy as np
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3.capture.vllm_backend import EXTENSION, engine_kwargs
    from eagle3.shards import save_safetensors_hashed
    from eagle3.testing.tiny import TinySpec, build_tiny_target
    from eagle3.vllm_ext import decode_states, encode_states

    spec = TinySpec(
        arch="llama",
        num_layers=2,
        hidden_size=7168,
        intermediate_size=64,
        num_heads=8,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=512,
        max_position_embeddings=4096,
    )
    target = build_tiny_target(work / "wide-target", spec)
    layers = [1, 1, 1]
    kw = engine_kwargs(str(target), args.dtype, args.batch_tokens, args.prompt_tokens + 1, 1)
    t = time.perf_counter()
    llm = LLM(worker_extension_cls=EXTENSION, **kw)
    engine_start_s = time.perf_counter() - t
    info = llm.collective_rpc("eagle3_capture_start", args=(layers, args.storage_dtype))[0]
    rng = np.random.default_rng(0)
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def prompts(n_tokens: int) -> list:
        return [
            TokensPrompt(prompt_token_ids=rng.integers(3, 500, args.prompt_tokens).tolist())
            for _ in range(max(1, n_tokens // args.prompt_tokens))
        ]

    llm.generate(prompts(2 * args.prompt_tokens), sp, use_tqdm=False)  # warm-up
    llm.collective_rpc("eagle3_capture_pop")
    rounds = []
    for i in range(args.rounds):
        ps = prompts(args.tokens_per_round)
        t0 = time.perf_counter()
        llm.generate(ps, sp, use_tqdm=False)
        t1 = time.perf_counter()
        popped = llm.collective_rpc("eagle3_capture_pop")[0]
        t2 = time.perf_counter()
        states = [decode_states(enc)[0] for enc in popped.values()]
        t3 = time.perf_counter()
        nbytes = sum(s.nbytes for s in states)
        ntok = sum(s.shape[0] for s in states)
        shard = work / f"driver-{i}.safetensors"
        save_safetensors_hashed(
            {"states": torch.cat(states)}, shard
        )  # one shard per round, as run_capture's buffer
        t4 = time.perf_counter()
        enc_t0 = time.perf_counter()
        for s in states[:4]:
            encode_states(s, s.shape[0])  # the worker's tobytes copy, for the split of the pop time
        enc_s = (time.perf_counter() - enc_t0) * len(states) / max(1, min(4, len(states)))
        shard.unlink()
        r = {
            "tokens": ntok,
            "bytes": nbytes,
            "bytes_per_token": nbytes / max(ntok, 1),
            "generate_s": t1 - t0,
            "pop_s": t2 - t1,
            "decode_s": t3 - t2,
            "driver_write_s": t4 - t3,
            "encode_s_est": enc_s,
        }
        r["pop_bytes_per_s"] = nbytes / r["pop_s"]
        r["driver_path_bytes_per_s"] = nbytes / (r["pop_s"] + r["decode_s"] + r["driver_write_s"])
        # written from the worker instead: the same shard write (its states are in one CPU buffer
        # per request after assemble), without encode, transfer and decode
        r["worker_write_bytes_per_s"] = nbytes / r["driver_write_s"]
        r["prefill_tokens_per_s"] = ntok / r["generate_s"]
        rounds.append(r)
        print(json.dumps(r), flush=True)
    # the worker writer (capture.writer = "worker"): meta (assemble, metadata back) + write_shard in
    # the worker
    worker_rounds = []
    for i in range(args.rounds):
        ps = prompts(args.tokens_per_round)
        t0 = time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        t1 = time.perf_counter()
        meta = llm.collective_rpc("eagle3_capture_meta")[0]
        t2 = time.perf_counter()
        by_ext = {rid.rsplit("-", 1)[0]: rid for rid in meta}
        rows = [
            [
                by_ext[o.request_id],
                k,
                f"s{k}",
                list(p["prompt_token_ids"]),
                [1] * len(p["prompt_token_ids"]),
            ]
            for k, (o, p) in enumerate(zip(outs, ps, strict=True))
        ]
        ntok = sum(m["num_tokens"] for m in meta.values())
        llm.collective_rpc(
            "eagle3_capture_write_shard",
            args=(
                str(work),
                900 + i,
                rows,
                0,
                len(rows),
                {},
                len(layers),
                7168,
                args.storage_dtype,
                "never",
            ),
        )
        entry = llm.collective_rpc("eagle3_capture_wait_shard", args=(900 + i,))[0]
        t3 = time.perf_counter()
        (work / entry["file"]).unlink()
        nbytes = ntok * KIMI_STATE_BYTES if args.storage_dtype == "bfloat16" else entry["bytes"]
        r = {
            "tokens": ntok,
            "bytes": nbytes,
            "file_bytes": entry["bytes"],
            "generate_s": t1 - t0,
            "meta_s": t2 - t1,
            "worker_write_s": t3 - t2,
            "bytes_per_s": nbytes / (t3 - t1),
        }
        worker_rounds.append(r)
        print(json.dumps({"worker_writer": r}), flush=True)
    llm.collective_rpc("eagle3_capture_stop")
    need = plan_rates()
    cal = calibrate(rounds[0]["bytes"])
    best = {
        k: max(r[k] for r in rounds)
        for k in ("pop_bytes_per_s", "driver_path_bytes_per_s", "worker_write_bytes_per_s")
    }
    med = {k: sorted(r[k] for r in rounds)[len(rounds) // 2] for k in best}
    med["worker_writer_bytes_per_s"] = sorted(r["bytes_per_s"] for r in worker_rounds)[
        len(worker_rounds) // 2
    ]

    import vllm

    res = {
        "date": utc_now(),
        "command": command_line(__file__),
        "machine": {
            **machine,
            "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
            "note": "a CPU whose cores other work shares: rates are lower bounds for this box",
        },
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "target": {**spec.__dict__, "engine_dtype": args.dtype},
        "layers": layers,
        "capture_info": info,
        "storage_dtype": args.storage_dtype,
        "engine": {k: v for k, v in kw.items() if k != "model"},
        "engine_start_s": engine_start_s,
        "rounds": rounds,
        "worker_writer_rounds": worker_rounds,
        "best": best,
        "median": med,
        "calibration": cal,
        "pop_in_memcpys": med["pop_bytes_per_s"]
        and cal["memcpy_bytes_per_s"] / med["pop_bytes_per_s"],
        "needed_on_8_gpus": need,
        "kimi_state_bytes_per_token": KIMI_STATE_BYTES,
        "headroom_median": {
            hw: {k: med[k] / v["needed_bytes_per_s"] for k in med}
            for hw, v in need.items()
            if "needed_bytes_per_s" in v
        },
    }
    gb = 1e9
    md = [
        "# Capture: bytes/s through collective_rpc + the driver, at Kimi-K2.5's width",
        "",
        f"- date: {res['date']}; command: `{res['command']}`",
        f"- machine: {machine_line(machine)} at start (cores shared with other work), "
        f"{tuple(res['machine']['load_avg_at_end'])} at end",
        f"- vLLM {vllm.__version__}, torch {torch.__version__}; target: random Llama, hidden 7168, "
        f"2 layers (eagle3.testing.tiny), engine {args.dtype}, TP 1; states {args.storage_dtype}, "
        f"layers {layers} + last = {rounds[0]['bytes_per_token']:.0f} bytes/token",
        "",
        "| round | tokens | GB | generate s | pop s | decode s | driver write s | pop GB/s | "
        "driver path GB/s | worker write GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        md.append(
            f"| {i + 1} | {r['tokens']} | {r['bytes'] / gb:.2f} | {r['generate_s']:.2f} | "
            f"{r['pop_s']:.2f} | {r['decode_s']:.3f} | {r['driver_write_s']:.2f} | "
            f"{r['pop_bytes_per_s'] / gb:.2f} | {r['driver_path_bytes_per_s'] / gb:.2f} | "
            f"{r['worker_write_bytes_per_s'] / gb:.2f} |"
        )
    md += [
        "",
        "Worker writer (capture.writer = worker: `eagle3_capture_meta` + "
        "`eagle3_capture_write_shard` in the worker, metadata back):",
        "",
        "| round | tokens | generate s | meta s | worker write s | GB/s |",
        "|---|---|---|---|---|---|",
    ]
    md += [
        f"| {i + 1} | {r['tokens']} | {r['generate_s']:.2f} | {r['meta_s']:.2f} | "
        f"{r['worker_write_s']:.2f} | {r['bytes_per_s'] / gb:.3f} |"
        for i, r in enumerate(worker_rounds)
    ]
    md += [
        "",
        "Single-thread primitives on this box (same bytes): memcpy "
        f"{cal['memcpy_bytes_per_s'] / gb:.2f} GB/s, numpy tobytes "
        f"{cal['tobytes_bytes_per_s'] / gb:.2f} GB/s, sha256 {cal['sha256_bytes_per_s'] / gb:.2f} "
        f"GB/s; the median pop costs as much as {res['pop_in_memcpys']:.1f} memcpys of its bytes.",
    ]
    md += [
        "",
        "Needed on 8 GPUs (`eagle3 plan --config configs/kimi-k2.5.yaml --hardware HW --num-gpus "
        "8`: capture tokens/s x 57,344 bytes/token) vs the median measured here:",
        "",
        "| hardware | capture tokens/s | needed GB/s | pop headroom | driver path headroom | "
        "write-only headroom | worker writer headroom |",
        "|---|---|---|---|---|---|---|",
    ]
    for hw, v in need.items():
        if "needed_bytes_per_s" not in v:
            md.append(f"| {hw} | error: {v.get('error', '')[:80]} |")
            continue
        h = res["headroom_median"][hw]
        md.append(
            f"| {hw} | {v['capture_tokens_per_s']:,.0f} | {v['needed_bytes_per_s'] / gb:.2f} | "
            f"{h['pop_bytes_per_s']:.2f}× | {h['driver_path_bytes_per_s']:.2f}× | "
            f"{h['worker_write_bytes_per_s']:.2f}× | {h['worker_writer_bytes_per_s']:.2f}× |"
        )
    write_result(Path(args.out), res, "\n".join(md) + "\n")
    print("\n".join(md))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
