"""The rounds of a refine run: each one rolls out its prompts, replays the current draft on them,
trains from it and scores it on the validation rollouts; a round whose round.json holds its key is
reused. Each round's last checkpoint becomes out/checkpoints/step-<global step>."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from eagle3.artifacts import list_checkpoints
from eagle3.io import read_json, write_json
from eagle3.refine.keys import Keys, round_seed
from eagle3.refine.plan import Plan, Prompts, say
from eagle3.refine.rollouts import ensure_rollouts, open_rollouts
from eagle3.refine.runtime import Runtime, load_draft
from eagle3.refine.scoring import rejected_loss, replay, replay_figures, score
from eagle3.refine.training import train_round, training_rows
from eagle3.train.onpolicy import StepWeighted

ROUND_RECORD = "round.json"


def run_rounds(
    plan: Plan, keys: Keys, prompts: Prompts, rt: Runtime, val: tuple[Any, list[str]]
) -> list[dict[str, Any]]:
    """Every round, each from the previous one's draft (the first from the input); returns their
    round.json records. Rounds past cfg.rounds (a rerun with fewer) and their checkpoints go."""
    out = Path(plan.cfg.out)
    records, start, step0 = [], plan.checkpoint, 0
    for r, key in enumerate(keys.rounds, start=1):
        rdir = out / "rounds" / f"round-{r}"
        rec = read_json(rdir / ROUND_RECORD) if (rdir / ROUND_RECORD).is_file() else {}
        if rec.get("key") == key and (rdir / "train" / "final" / "model.safetensors").is_file():
            say(f"round {r}: reused ({rdir})")
        else:
            _drop_checkpoints_after(out, step0)
            (rdir / ROUND_RECORD).unlink(missing_ok=True)
            prompts_r, roll_key = prompts.per_round[r - 1], keys.rollouts[r - 1]
            rec = run_round(plan, r, key, rdir, start, prompts_r, roll_key, rt, val, step0)
            _move_checkpoint(rdir / "train", out, plan.cfg.steps_per_round, rec["step"])
            write_json(rdir / ROUND_RECORD, rec)
            v = rec["validation"]["all"]
            say(
                f"round {r}: validation α {v['alpha']}, τ {v['tau']}; loss at the rejected "
                f"positions {rec['rejected_loss_before']} -> {rec['rejected_loss_after']}"
            )
        records.append(rec)
        start, step0 = rdir / "train" / "final", rec["step"]
    _drop_stale(out, plan.cfg.rounds, step0)
    return records


def run_round(
    plan: Plan,
    r: int,
    key: str,
    rdir: Path,
    start: Path,
    prompts: list,
    roll_key: str,
    rt: Runtime,
    val: tuple[Any, list[str]],
    step0: int,
) -> dict[str, Any]:
    """Round r from the draft in `start`: rollouts, replay, training (rdir/train), validation.
    Returns its round.json record."""
    c, t0 = plan.cfg, time.time()
    roll = ensure_rollouts(plan, rdir, roll_key, prompts, seed=round_seed(c.seed, r))
    samples, _ = open_rollouts(plan, rdir)
    model, ttt = load_draft(plan, start, rt)
    before = replay(plan, ttt, samples, rt, rejected_weight=c.rejected_weight)
    errors = StepWeighted(samples, before.error_masks)  # each round's first rejected step only
    loss_before = rejected_loss(plan, ttt, errors, rt)
    weights, trained = training_rows(plan, samples, before)
    if not trained:
        raise ValueError(
            f"refine round {r}: no rollout in {rdir} holds a drafting round to train "
            f"on ({len(samples)} rollouts); raise --max-new-tokens or --num-prompts"
        )
    say(
        f"round {r}: {before.counts.num_rounds} rounds replayed on {len(samples)} rollouts, "
        f"{before.num_rejected_blocks} rejected blocks, τ {before.counts.tau:.3f}; training "
        f"{c.steps_per_round} steps"
    )
    state = train_round(
        plan, r, model, StepWeighted(samples, weights), trained, rdir / "train", rt, step0
    )
    after = replay(plan, ttt, samples, rt)
    return {
        "key": key,
        "round": r,
        "step": step0 + c.steps_per_round,
        "num_prompts": len(prompts),
        "rollouts": {k: v for k, v in roll.items() if k != "key"},
        "replay_before": replay_figures(before),
        "replay_after": replay_figures(after),
        "rejected_loss_before": loss_before,
        "rejected_loss_after": rejected_loss(plan, ttt, errors, rt),
        "train_loss": state.last_loss,
        "num_trained_rollouts": len(trained),
        "validation": score(plan, ttt, *val, rt),
        "wall_s": round(time.time() - t0, 1),
    }


def _move_checkpoint(train_dir: Path, out: Path, local_step: int, global_step: int) -> None:
    """The round's last checkpoint becomes out/checkpoints/step-<global step>."""
    src = train_dir / "checkpoints" / f"step-{local_step}"
    if src.is_dir():
        dst = out / "checkpoints" / f"step-{global_step}"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dst, ignore_errors=True)
        src.replace(dst)
        shutil.rmtree(train_dir / "checkpoints", ignore_errors=True)


def _drop_checkpoints_after(out: Path, step: int) -> None:
    for ck in list_checkpoints(out):
        if int(ck.name.split("-")[1]) > step:
            shutil.rmtree(ck)


def _drop_stale(out: Path, rounds: int, step: int) -> None:
    """Rounds past the configured number (a rerun with fewer rounds) and their checkpoints go."""
    _drop_checkpoints_after(out, step)
    for rdir in (out / "rounds").glob("round-*"):
        index = rdir.name.split("-")[1]
        if index.isdigit() and int(index) > rounds:
            shutil.rmtree(rdir)
