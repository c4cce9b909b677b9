"""What a refine run leaves, laid out as a training run: best/ and final/, logs/metrics.jsonl,
curves.png and refine.json (the summary `eagle3 refine` prints, with the run's content key)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.io import atomic_dir, atomic_path, read_json, write_json
from eagle3.refine.plan import Plan, Prompts, output_metadata
from eagle3.refine.scoring import select_round
from eagle3.train.metrics import plot_curves

SUMMARY = "refine.json"


@dataclass
class RefineResult:
    out: Path
    best_dir: Path
    final_dir: Path
    checkpoint: Path  # the refined input
    num_speculative_tokens: int
    num_rounds: int
    selected_round: int  # best/'s round (0 = the input draft)
    num_rollouts: int  # training rollouts, every round
    num_rejected_blocks: int  # replayed rounds with a rejected token, every round's rollouts
    alpha_before: dict[str, list[float]]  # validation α at positions 1..k per temperature, "all"
    alpha_after: dict[str, list[float]]  # the same for best/
    tau_before: dict[str, float]
    tau_after: dict[str, float]
    rounds: list[dict[str, Any]] = field(default_factory=list)  # each round's figures
    num_val_prompts: int = 0
    num_train_prompts: int = 0
    wall_s: float = 0.0
    reused: bool = False  # the whole run was read back (same inputs)


def write_outputs(
    plan: Plan, key: str, before: dict, records: list[dict], prompts: Prompts, t0: float
) -> RefineResult:
    """best/ (the round of the highest pooled validation τ; 0 = the input), final/,
    logs/metrics.jsonl, curves.png and refine.json."""
    out = Path(plan.cfg.out)
    vals = [before] + [rec["validation"] for rec in records]
    sel = select_round(vals)
    _write_drafts(plan, before, records, vals, sel)
    write_log(out, before, records)
    plot_curves(out / "logs" / "metrics.jsonl", out / "curves.png")
    summary = {
        "key": key,
        "out": str(out),
        "best_dir": str(out / "best"),
        "final_dir": str(out / "final"),
        "checkpoint": str(plan.checkpoint),
        "num_speculative_tokens": plan.k,
        "num_rounds": len(records),
        "selected_round": sel,
        "num_rollouts": sum(rec["rollouts"]["num_rollouts"] for rec in records),
        "num_rejected_blocks": sum(rec["replay_before"]["num_rejected_blocks"] for rec in records),
        "alpha_before": {k: v["alpha"] for k, v in before.items()},
        "alpha_after": {k: v["alpha"] for k, v in vals[sel].items()},
        "tau_before": {k: v["tau"] for k, v in before.items()},
        "tau_after": {k: v["tau"] for k, v in vals[sel].items()},
        "rounds": [{k: v for k, v in rec.items() if k != "key"} for rec in records],
        "num_val_prompts": prompts.num_val,
        "num_train_prompts": len(prompts.pool),
        "wall_s": round(time.time() - t0, 1),
    }
    write_json(out / SUMMARY, summary)
    return read_result(summary, reused=False)


def _write_drafts(
    plan: Plan, before: dict, records: list[dict], vals: list[dict], sel: int
) -> None:
    """best/ (round `sel`) and final/ (the last round): the round's weights and the metadata."""
    out = Path(plan.cfg.out)
    dirs = [plan.checkpoint] + [
        out / "rounds" / f"round-{rec['round']}" / "train" / "final" for rec in records
    ]
    steps = [0] + [rec["step"] for rec in records]
    info = {
        "rounds": len(records),
        "selected_round": sel,
        "alpha_before": before["all"]["alpha"],
        "tau_before": before["all"]["tau"],
        "validation_before": before,
    }
    for name, i in (("best", sel), ("final", len(records))):
        after = vals[i]["all"]
        meta = output_metadata(
            plan,
            steps[i],
            {"tau_replay": after["tau"]},
            {
                **info,
                "round": i,
                "alpha_after": after["alpha"],
                "tau_after": after["tau"],
                "validation_after": vals[i],
            },
        )
        with atomic_dir(out / name) as tmp:
            shutil.copy2(dirs[i] / "model.safetensors", tmp / "model.safetensors")
            meta.save(tmp)


def write_log(out: Path, before: dict, records: list[dict]) -> None:
    """logs/metrics.jsonl: each round's train records at global steps, then its refine records."""
    lines, step0 = [_val_record(0, 0, before)], 0
    for rec in records:
        log = out / "rounds" / f"round-{rec['round']}" / "train" / "logs" / "metrics.jsonl"
        for line in log.read_text().splitlines() if log.is_file() else []:
            if line.strip():
                x = json.loads(line)
                lines.append({**x, "step": step0 + x["step"], "round": rec["round"]})
        lines.append(_val_record(rec["step"], rec["round"], rec["validation"]))
        lines.append(
            {
                "step": rec["step"],
                "split": "refine_rollouts",
                "round": rec["round"],
                **{f"before_{k}": v for k, v in rec["replay_before"].items()},
                **{f"after_{k}": v for k, v in rec["replay_after"].items()},
                "rejected_loss_before": rec["rejected_loss_before"],
                "rejected_loss_after": rec["rejected_loss_after"],
            }
        )
        step0 = rec["step"]
    with atomic_path(out / "logs" / "metrics.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _val_record(step: int, r: int, val: dict) -> dict[str, Any]:
    rec: dict[str, Any] = {"step": step, "split": "refine_val", "round": r}
    for label, v in val.items():
        rec[f"tau_{label}"] = v["tau"]
        rec.update({f"alpha_{label}_{j + 1}": a for j, a in enumerate(v["alpha"])})
    return rec


def read_result(summary: dict[str, Any], reused: bool) -> RefineResult:
    """The RefineResult of a refine.json summary."""
    s = summary
    return RefineResult(
        out=Path(s["out"]),
        best_dir=Path(s["best_dir"]),
        final_dir=Path(s["final_dir"]),
        checkpoint=Path(s["checkpoint"]),
        num_speculative_tokens=s["num_speculative_tokens"],
        num_rounds=s["num_rounds"],
        selected_round=s["selected_round"],
        num_rollouts=s["num_rollouts"],
        num_rejected_blocks=s["num_rejected_blocks"],
        alpha_before=s["alpha_before"],
        alpha_after=s["alpha_after"],
        tau_before=s["tau_before"],
        tau_after=s["tau_after"],
        rounds=s["rounds"],
        num_val_prompts=s["num_val_prompts"],
        num_train_prompts=s["num_train_prompts"],
        wall_s=s["wall_s"],
        reused=reused,
    )


def read_finished(out: Path, key: str) -> RefineResult | None:
    """The result of a finished run of `key` in `out` (its best/, final/ and refine.json), read
    back; None when `out` holds no such run."""
    summary = out / SUMMARY
    done = all((out / x / "model.safetensors").is_file() for x in ("best", "final"))
    if done and summary.is_file() and read_json(summary).get("key") == key:
        return read_result(read_json(summary), reused=True)
    return None
