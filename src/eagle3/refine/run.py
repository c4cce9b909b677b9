"""`run_refine`, the stage: a refine run as a sequence of its parts (eagle3.refine)."""

from __future__ import annotations

import time
from pathlib import Path

from eagle3.config import RefineConfig
from eagle3.lock import dir_lock
from eagle3.refine.keys import plan_keys, round_seed
from eagle3.refine.outputs import RefineResult, read_finished, write_outputs
from eagle3.refine.plan import Plan, plan_prompts, read_plan, say
from eagle3.refine.rollouts import ensure_rollouts, open_rollouts
from eagle3.refine.rounds import run_rounds
from eagle3.refine.runtime import load_draft, open_runtime
from eagle3.refine.scoring import score


def run_refine(cfg: RefineConfig) -> RefineResult:
    """Refine cfg.checkpoint on-policy for cfg.rounds rounds into cfg.out (eagle3.refine)."""
    t0 = time.time()
    plan = read_plan(cfg)
    with dir_lock(cfg.out, "refine out"):
        return _refine(plan, t0)


def _refine(plan: Plan, t0: float) -> RefineResult:
    c, out = plan.cfg, Path(plan.cfg.out)
    prompts = plan_prompts(plan)
    keys = plan_keys(plan, prompts)
    finished = read_finished(out, keys.rounds[-1])
    if finished is not None:
        say(f"{out} already holds this refinement (key {keys.rounds[-1][:12]}); nothing to do")
        return finished
    say(
        f"{prompts.num_found} prompts ({prompts.num_val} validation, {len(prompts.pool)} "
        f"training; skipped {prompts.num_skipped}), k = {plan.k}, {c.rounds} round(s) of "
        f"{c.num_prompts} prompts x {len(c.temperatures)} temperature(s)"
    )
    seed = round_seed(c.seed, 0)
    ensure_rollouts(plan, out / "validation", keys.validation, prompts.validation, seed=seed)
    val = open_rollouts(plan, out / "validation")
    rt = open_runtime(plan)
    _, ttt = load_draft(plan, plan.checkpoint, rt)
    before = score(plan, ttt, *val, rt)
    say(f"validation before: α {before['all']['alpha']}, τ {before['all']['tau']}")
    records = run_rounds(plan, keys, prompts, rt, val)
    return write_outputs(plan, keys.rounds[-1], before, records, prompts, t0)
