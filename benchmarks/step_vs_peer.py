#!/usr/bin/env python3
"""Merge one device call's train-step figures, ours and the peer's (speculators 0.9.0), into the
training-speed table.

    python3 benchmarks/step_vs_peer.py --ours W/ours-llama W/ours-kimi --peer W/peer/results.json \\
        --cache-run W/cache --out-dir $OUT --command "bash benchmarks/gpu_step_vs_peer.sh ..."

Inputs: each --ours DIR holds a `train_step.json` of benchmarks/train_step.py (its `dims_name` says
which draft dims); --peer is the peer harness's `results.json` (../shared/peerbench/bench_eagle3.py;
Llama-3.1-8B draft dims by default); --cache-run is a second train_step.py process that loaded the
first one's compile cache (--compile-cache) on the same machine. Any input may be missing (a phase
the budget or a failure cut): its fields are null and `missing` says why. Output:
`train_step_vs_peer.json` + `.md` in --out-dir, one row per (dims, K, T):
    {"config": "K7-T8192", "dims": "llama-3.1-8b", "ours_tok_s", "peer_tok_s", "ratio",
     "ours_first_step_s", "peer_first_step_s", "gpu", "date", "command", ...ms/step, peak GiB,
     MFU of both}
Imports the standard library only (runs anywhere, also on the CPU in the tests).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt, utc_now, write_result

#: the peer's default dims (bench_eagle3.py --hidden 4096 ... --draft-vocab 32000) = ours
#: "llama-3.1-8b"
PEER_DIMS = "llama-3.1-8b"


def read_json(path: Path | None) -> tuple[dict | None, str | None]:
    if path is None:
        return None, "not run in this call"
    if not path.is_file():
        return (
            None,
            f"{path} missing (that phase wrote nothing: budget, timeout or crash; see its log)",
        )
    try:
        return json.loads(path.read_text()), None
    except json.JSONDecodeError as e:
        return None, f"{path} unreadable ({e})"


def our_rows(res: dict) -> list[dict]:
    """Fast-path rows of one train_step.json, keyed by config name."""
    dims = res.get("dims_name") or ("smoke" if res.get("smoke") else "llama-3.1-8b")
    out = []
    for c in res.get("configs", []):
        if c.get("kind") != "fast" or c.get("batch", 1) != 1:
            continue
        world = c.get(
            "world", 1
        )  # DDP rows (--ddp N): tokens/s over all GPUs, never compared with the peer
        out.append(
            {
                "config": f"K{c['K']}-T{c['seq']}" + (f"-DDPx{world}" if world > 1 else ""),
                "dims": dims,
                "ours_status": c.get("status"),
                "ours_reason": c.get("reason"),
                "ours_ms": c.get("ms_per_step"),
                "ours_tok_s": c.get("tokens_per_s"),
                "ours_first_step_s": c.get("first_step_s"),
                "ours_peak_gib": c.get("peak_mem_gib"),
                "ours_mfu": c.get("mfu"),
                "ours_compile_mode": c.get("compile_mode"),
                "ours_compile": c.get("compile"),
                "ours_fallback": c.get("fallback"),
                "ours_fallback_reason": c.get("split_compile_error"),
            }
        )
    return out


def peer_rows(res: dict) -> dict[str, dict]:
    out = {}
    for c in res.get("configs", []):
        key = f"K{c['ttt_steps']}-T{c['T']}"
        out[key] = {
            "peer_status": "ok"
            if "median_step_ms" in c
            else (c.get("error") or c.get("skipped") or "?"),
            "peer_ms": c.get("median_step_ms"),
            "peer_tok_s": c.get("tokens_per_s"),
            "peer_first_step_s": c.get("first_step_s_incl_compile"),
            "peer_peak_gib": c.get("peak_mem_GiB"),
            "peer_mfu": c.get("MFU_vs_measured_matmul"),
        }
    return out


def merge(ours: list[Path], peer: Path | None, cache_run: Path | None, command: str) -> dict:
    missing, rows, gpu, date = [], [], None, None
    for d in ours:
        res, why = read_json(d / "train_step.json")
        if res is None:
            missing.append(f"ours {d}: {why}")
            continue
        gpu = gpu or res["machine"].get("gpu") or res["machine"].get("device")
        date = date or res.get("date")
        if res.get("partial"):
            missing.append(f"ours {d}: partial ({res['partial']})")
        rows += our_rows(res)
    pres, why = read_json(peer)
    prow = {}
    if pres is None:
        missing.append(f"peer: {why}")
    else:
        prow = peer_rows(pres)
        gpu = gpu or (pres.get("env") or {}).get("gpu")
    null_peer = dict.fromkeys(
        ("peer_status", "peer_ms", "peer_tok_s", "peer_first_step_s", "peer_peak_gib", "peer_mfu")
    )
    seen = set()
    for r in rows:
        p = prow.get(r["config"]) if r["dims"] == PEER_DIMS else None
        r.update(p or null_peer)
        seen.add((r["dims"], r["config"]))
        r["ratio"] = (
            r["ours_tok_s"] / r["peer_tok_s"]
            if r.get("ours_tok_s") and r.get("peer_tok_s")
            else None
        )
        r["first_step_ratio"] = (
            r["ours_first_step_s"] / r["peer_first_step_s"]
            if r.get("ours_first_step_s") and r.get("peer_first_step_s")
            else None
        )
    for key, p in prow.items():  # peer configs we did not run: still a row
        if (PEER_DIMS, key) not in seen:
            rows.append(
                {
                    "config": key,
                    "dims": PEER_DIMS,
                    "ours_status": "not run",
                    "ours_tok_s": None,
                    "ours_first_step_s": None,
                    **p,
                    "ratio": None,
                    "first_step_ratio": None,
                }
            )
    date = date or utc_now()
    for r in rows:
        r.update(gpu=gpu, date=date, command=command)
    out = {
        "date": date,
        "gpu": gpu,
        "command": command,
        "configs": rows,
        "missing": missing,
        "peer_env": (pres or {}).get("env"),
        "peer_matmul_tflops": (pres or {}).get("matmul_8192_bf16_TFLOPs"),
    }
    if cache_run is not None:
        cres, why = read_json(cache_run / "train_step.json")
        if cres is None:
            out["compile_cache_round_trip"] = {"status": why}
        else:
            first = next((c for c in cres.get("configs", []) if c.get("kind") == "fast"), {})
            cold = next(
                (
                    r
                    for r in rows
                    if r["dims"] == (cres.get("dims_name") or PEER_DIMS)
                    and r["config"] == f"K{first.get('K')}-T{first.get('seq')}"
                ),
                {},
            )
            out["compile_cache_round_trip"] = {
                "config": f"K{first.get('K')}-T{first.get('seq')}",
                "dims": cres.get("dims_name"),
                "status": first.get("status"),
                "first_step_s_cache_loaded": first.get("first_step_s"),
                "first_step_s_cold": cold.get("ours_first_step_s"),
                "ms_per_step": first.get("ms_per_step"),
                "load": cres.get("compile_cache"),
                "profile": first.get("profile"),
                "note": "second process on the SAME machine, with its own empty "
                "TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, seeded only by "
                "torch.compiler.load_cache_artifacts of the first process's file; not a fresh "
                "machine (driver/CUDA caches and the page cache are warm)",
            }
        if cres is not None:
            n = cres.get("numerics") or {}
            out["numerics"] = {
                "pass": n.get("pass"),
                "fp32_pass": n.get("fp32_pass"),
                "bf16_fast_vs_naive": n.get("bf16_fast_vs_naive"),
                "skipped": n.get("skipped"),
                "error": n.get("error"),
                "attention_only": n.get("attention_only_fp32_check"),
            }
    return out


def markdown(res: dict) -> str:
    L = [
        f"# Train step, ours vs speculators 0.9.0 (same call) — {res['gpu']}",
        "",
        f"{res['date']} · `{res['command']}`",
        "",
        "| dims | config | ours ms | ours tok/s | peer ms | peer tok/s | ratio | ours first step s "
        "| peer first step s | ours peak GiB | peer peak GiB | ours MFU | peer MFU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["configs"]:
        st = "" if r.get("ours_status") in ("ok", None) else f" ({r['ours_status']})"
        st += f" (fallback: {r['ours_fallback']})" if r.get("ours_fallback") else ""
        L.append(
            f"| {r['dims']} | {r['config']}{st} | {fmt(r.get('ours_ms'))} | "
            f"{fmt(r.get('ours_tok_s'), ',.0f')} | {fmt(r.get('peer_ms'))} | "
            f"{fmt(r.get('peer_tok_s'), ',.0f')} | {fmt(r.get('ratio'), ',.2f', '×')} | "
            f"{fmt(r.get('ours_first_step_s'))} | {fmt(r.get('peer_first_step_s'))} | "
            f"{fmt(r.get('ours_peak_gib'))} | {fmt(r.get('peer_peak_gib'))} | "
            f"{fmt(100 * r['ours_mfu'] if r.get('ours_mfu') else None, unit='%')} | "
            f"{fmt(100 * r['peer_mfu'] if r.get('peer_mfu') else None, unit='%')} |"
        )
    num = res.get("numerics")
    if num:
        L += [
            "",
            "GPU numerics (cache phase: fast step incl. its flex attention vs the naive "
            f"reference): {num}",
        ]
    c = res.get("compile_cache_round_trip")
    if c:
        if "first_step_s_cache_loaded" in c:
            L += [
                "",
                f"Compile cache round trip ({c['dims']} {c['config']}): first step "
                f"{fmt(c['first_step_s_cache_loaded'])} s with the cache loaded vs "
                f"{fmt(c['first_step_s_cold'])} s cold; {c['note']}.",
            ]
        else:
            L += ["", f"Compile cache round trip: {c['status']}"]
    if res.get("missing"):
        L += ["", "Missing or partial: " + "; ".join(res["missing"])]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ours", nargs="+", type=Path, required=True, metavar="DIR")
    p.add_argument("--peer", type=Path, default=None, metavar="results.json")
    p.add_argument("--cache-run", type=Path, default=None, metavar="DIR")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--command", default=" ".join(sys.argv))
    a = p.parse_args(argv)
    res = merge(a.ours, a.peer, a.cache_run, a.command)
    write_result(a.out_dir / "train_step_vs_peer", res, markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
