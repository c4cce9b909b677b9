"""refbench report: collect one refbench run into benchmarks/results/refbench.{json,md}.

A run has two halves (the GPU box has no vLLM, this CPU has no GPU):
  1. on the GPU (carry built by `bash benchmarks/gpu_call.sh carry refbench`):
     `bash benchmarks/gpu_call.sh run --budget-s 480 --pack runs/refbench-gpu -- python3 -m
     eagle3.cli run --no-prefect --config configs/refbench-gpu.yaml` (regenerate -> prepare ->
     capture -> vocab -> train -> export); its pack.tgz unpacked under RUN_DIR;
  2. here: `eagle3 evaluate --config configs/refbench.yaml --draft RUN_DIR/draft --out EVAL_DIR`.
This script reads both and writes the figures the refbench protocol asks for (config, sample/token
counts, wall time per stage, tau and per-position counts).

    python benchmarks/refbench.py --run-dir runs/refbench/gpu --eval-dir runs/refbench/evaluate \
        --note "..." [--gpu-call-s 488]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from eagle3.artifacts import migrate_record

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, write_result

BASELINES = {"n-gram (min 2, max 4)": 1.73, "speculators 0.9.0 EAGLE-3": 2.26}


def _read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _train_summary(run: Path) -> dict[str, Any]:
    rows = [
        json.loads(line)
        for line in (run / "train" / "logs" / "metrics.jsonl").read_text().splitlines()
        if line
    ]
    train = [r for r in rows if r.get("split") == "train"]
    val = [r for r in rows if r.get("split") == "val"]
    best = max(val, key=lambda r: r["sim_accept_len"]) if val else {}
    last = train[-1] if train else {}
    return {
        "num_steps": last.get("step"),
        "epochs_done": round(last.get("epoch", 0.0), 2),
        "final_train_loss": last.get("loss"),
        "final_train_sim_accept_len_k7": last.get("sim_accept_len"),
        "best_val_step": best.get("step"),
        "best_val_sim_accept_len_k7": best.get("sim_accept_len"),
        "best_val_acc_per_step": [best.get(f"acc_{j}") for j in range(7) if f"acc_{j}" in best],
        "best_val_cond_acc_per_step": [
            best.get(f"cond_acc_{j}") for j in range(7) if f"cond_acc_{j}" in best
        ],
    }


def build_report(run: Path, eval_dir: Path, note: str, gpu_call_s: float | None) -> dict[str, Any]:
    regen, prep = (
        _read(run / "regenerated" / "manifest.json"),
        _read(run / "prepared" / "manifest.json"),
    )
    cap, voc = (
        migrate_record(_read(run / "captured" / "manifest.json")),
        _read(run / "vocab" / "coverage.json"),
    )
    draft, ev = _read(run / "draft" / "eagle3_draft.json"), _read(eval_dir / "results.json")
    gpu = (run / "gpu.txt").read_text().strip().splitlines() if (run / "gpu.txt").is_file() else []
    return {
        "protocol": "../shared/refbench/README.md (target-a-llama, GSM8K train regenerated greedy "
        "<= 256 tokens, aux ids (2, 4, 5), k = 3, 200 eval prompts, temperature 0, max_tokens 128, "
        "bf16, max_model_len 1024)",
        "note": note,
        "gpu": gpu,
        "config_files": [
            "configs/refbench-gpu.yaml (train side)",
            "configs/refbench.yaml (evaluate)",
        ],
        "data": {
            "num_prompts": regen.get("counts", {}).get("input_rows"),
            "num_regenerated": regen.get("counts", {}).get("written_conversations"),
            "generated_tokens": regen.get("counts", {}).get("generated_tokens"),
            "finish_reasons": regen.get("finish_reasons"),
            "num_samples": prep.get("num_samples"),
            "num_tokens": prep.get("num_tokens"),
            "num_supervised_tokens": prep.get("num_supervised_tokens"),
            "aux_layer_ids": cap.get("aux_layer_ids"),
            "capture_bytes_per_token": cap.get("bytes_per_token"),
            "draft_vocab_size": voc.get("draft_vocab_size"),
            "draft_vocab_coverage": voc.get("coverage"),
        },
        "wall_s": {
            "regenerate_gpu": regen.get("elapsed_s"),
            "gpu_call_total": gpu_call_s,
        },
        "train": {
            **_train_summary(run),
            "draft_config": draft.get("draft_config"),
            "checkpoint_step": draft.get("step"),
        },
        "result": {
            "tau": ev.get("acceptance_length"),
            "num_drafts": ev.get("num_drafts"),
            "num_accepted": ev.get("num_accepted_tokens"),
            "accepted_per_position": ev.get("accepted_per_position"),
            "acceptance_rate_per_position": ev.get("acceptance_rate_per_position"),
            "tokens_per_s_spec": ev.get("spec_tokens_per_s"),
            "tokens_per_s_baseline": ev.get("baseline_tokens_per_s"),
            "speedup_cpu": ev.get("speedup"),
        },
        "baselines_tau": BASELINES,
        "evaluate_raw": ev,
    }


def render_markdown(r: dict[str, Any]) -> str:
    res, d, t = r["result"], r["data"], r["train"]
    pos = res.get("accepted_per_position") or []
    lines = [
        "# refbench: EAGLE-3 draft for target-a-llama",
        "",
        f"Protocol: {r['protocol']}.",
        f"GPU (train side): {', '.join(r['gpu'])}. {r['note']}",
        "",
        "| method | τ (k=3) | per-position accepted |",
        "|---|---|---|",
        "| n-gram prompt lookup (min 2, max 4) | 1.73 | 1412 / 703 / 379 |",
        "| speculators 0.9.0 EAGLE-3 (refbench README) | 2.26 | 5070 / 3561 / 2612 |",
        f"| **eagle3-pipeline** | **{res['tau']:.3f}** | {' / '.join(str(x) for x in pos)} |"
        if res.get("tau") is not None
        else "| eagle3-pipeline | (not evaluated) | |",
        "",
        f"- data: {d['num_regenerated']} of {d['num_prompts']} GSM8K-train prompts regenerated by "
        f"the target ({d['generated_tokens']} generated tokens, finish {d['finish_reasons']}); "
        f"{d['num_tokens']} tokens, {d['num_supervised_tokens']} supervised; aux_layer_ids "
        f"{d['aux_layer_ids']} + last ({d['capture_bytes_per_token']} bytes/token); draft vocab "
        f"{d['draft_vocab_size']} (coverage {d['draft_vocab_coverage']:.4f})",
        f"- train: {t['num_steps']} steps ({t['epochs_done']} epochs), exported checkpoint = step "
        f"{t['checkpoint_step']} (best validation simulated acceptance length over 7 steps: "
        f"{t['best_val_sim_accept_len_k7']:.3f} at step {t['best_val_step']})",
        f"- wall time: {r['wall_s']}",
        f"- decode on this 2-core CPU: {res.get('tokens_per_s_spec')} tok/s with the draft vs "
        f"{res.get('tokens_per_s_baseline')} without (speed-up {res.get('speedup_cpu')})",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--run-dir", type=Path, required=True, help="unpacked GPU run (regenerated/, ..., draft/)"
    )
    ap.add_argument("--eval-dir", type=Path, required=True, help="eagle3 evaluate --out directory")
    ap.add_argument(
        "--note", default="", help="free text: how the run was made (dates, commands, deviations)"
    )
    ap.add_argument("--gpu-call-s", type=float, default=None, help="wall seconds of the GPU call")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    report = build_report(args.run_dir, args.eval_dir, args.note, args.gpu_call_s)
    write_result(args.out_dir / "refbench", report, render_markdown(report))
    print(render_markdown(report))


if __name__ == "__main__":
    main()
