"""Content keys of a refine run: a round's rollouts are keyed by their prompts and settings (not by
the draft: the target's text does not depend on it), a round by the previous round's key (the
first by the input weights), its rollouts, every replay and training setting, the supervised
capture and the validation set. A rerun reuses what is unchanged: rounds, rollouts, or the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3.artifacts import CaptureManifest
from eagle3.data.rollout import prompts_sha256
from eagle3.io import sha256_file, sha256_json
from eagle3.refine.plan import Plan, Prompts


def round_seed(seed: int, r: int) -> int:
    """The sampling seed of round r's rollouts (0: the validation rollouts)."""
    return seed + 1000 * r


def rollout_settings(plan: Plan) -> dict[str, Any]:
    """What makes rollouts and their capture what they are, besides their prompts and seed."""
    c = plan.cfg
    return {
        "target": plan.identity,
        "temperatures": list(c.temperatures),
        "top_p": c.top_p,
        "max_new_tokens": c.max_new_tokens,
        "backend": plan.backend,
        "dtype": c.dtype,
        "storage_dtype": c.storage_dtype,
        "aux": plan.captured_aux,
    }


def rollout_key(plan: Plan, prompts_sha256: str, seed: int) -> str:
    return sha256_json({"prompts": prompts_sha256, "seed": seed, **rollout_settings(plan)})


def input_key(plan: Plan) -> str:
    """The input draft's key: its weights, draft config and aux layer ids."""
    return sha256_json(
        {
            "weights": sha256_file(plan.checkpoint / "model.safetensors"),
            "draft": plan.meta.draft_config,
            "aux": plan.aux_layer_ids,
        }
    )


def round_keys(plan: Plan, input_key: str, val_key: str, rollout_keys: list[str]) -> list[str]:
    """Round r's content key: the previous one's (the first: the input weights'), its rollouts,
    every replay and training setting, the supervised capture and the validation set."""
    c = plan.cfg
    train = plan.train.model_dump(mode="json", exclude={"device", "out", "target"})
    supervised = None
    if plan.supervised:
        shards = CaptureManifest.load_combined(plan.supervised).shards
        supervised = sha256_json([e.to_dict() for e in shards])
    keys, prev = [], input_key
    for r, rk in enumerate(rollout_keys, start=1):
        prev = sha256_json(
            {
                "previous": prev,
                "round": r,
                "rollouts": rk,
                "k": plan.k,
                "train": train,
                "supervised": supervised,
                "supervised_share": c.supervised_share,
                "loss_rows": c.loss_rows,
                "rejected_weight": c.rejected_weight,
                "validation": val_key,
            }
        )
        keys.append(prev)
    return keys


@dataclass
class Keys:
    """Every content key of a run."""

    validation: str  # the validation rollouts'
    rollouts: list[str]  # round r's rollouts' at index r - 1
    rounds: list[str]  # round r's at index r - 1; the last one is the run's


def plan_keys(plan: Plan, prompts: Prompts) -> Keys:
    """The keys of the validation rollouts, each round's rollouts and each round."""
    seed = plan.cfg.seed
    val_key = rollout_key(plan, prompts_sha256(prompts.validation), round_seed(seed, 0))
    roll_keys = [
        rollout_key(plan, prompts_sha256(p), round_seed(seed, r))
        for r, p in enumerate(prompts.per_round, start=1)
    ]
    return Keys(val_key, roll_keys, round_keys(plan, input_key(plan), val_key, roll_keys))
