"""What a refine run reads and decides before anything runs: the checkpoint and its recorded
training settings, k, the supervised capture, each round's training config, the prompts of the
validation set and of every round, and the metadata its drafts are saved with."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.artifacts import CaptureManifest, DraftMetadata, DraftVocab, PreparedMeta
from eagle3.config import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    ConfigError,
    RefineConfig,
    TrainConfig,
    deep_merge,
)
from eagle3.config.train_options import TRAIN_GROUPS
from eagle3.data.rollout import data_dirs, read_prompts, round_prompts, split_prompts
from eagle3.export import WEIGHTS, resolve_checkpoint
from eagle3.integrity import check_target_identity
from eagle3.io import read_json
from eagle3.model.draft import text_config


def say(message: str) -> None:
    print(f"refine: {message}", file=sys.stderr, flush=True)


@dataclass
class Plan:
    """Everything resolved from the config and the checkpoint before anything runs."""

    cfg: RefineConfig
    checkpoint: Path  # the dir holding the input weights + eagle3_draft.json
    meta: DraftMetadata
    train: TrainConfig  # each round's training config: the checkpoint's + refine's overrides
    k: int
    backend: str
    num_layers: int
    captured_aux: list[int]  # the aux ids the rollouts are captured at (the draft's capture's)
    aux_layer_ids: list[int]  # the draft's
    identity: dict[str, Any]
    supervised: str | None  # capture dir(s) mixed in; None when supervised_share is 0
    max_prompt_tokens: int


def read_plan(cfg: RefineConfig) -> Plan:
    """The checkpoint, k, the supervised capture and the training config; a ConfigError naming the
    field and the fix for anything missing or inconsistent."""
    cfg.require("target", "checkpoint", "data", "out")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "eagle3 refine runs in one process on one device (its rollouts and "
            "rounds are not split across ranks); start it without torchrun"
        )
    ck = resolve_checkpoint(cfg.checkpoint)
    meta = DraftMetadata.load(ck)
    tpath = Path(cfg.target) / "config.json"
    if not tpath.is_file():
        raise ConfigError(
            f"RefineConfig.target = {cfg.target!r} has no config.json; pass --target "
            "with the target model dir the draft was trained for"
        )
    identity = check_target_identity(
        meta.recorded_target(), f"checkpoint {ck}", cfg.target, cfg.allow_target_mismatch
    )
    num_layers = int(text_config(read_json(tpath))["num_hidden_layers"])
    trained_with = recorded_settings(meta)
    k = int(
        cfg.num_speculative_tokens
        or trained_with.get("num_speculative_tokens")
        or DEFAULT_NUM_SPECULATIVE_TOKENS
    )
    _check_data(cfg)
    check_vocab(cfg, meta, ck / WEIGHTS)
    supervised = _supervised_capture(cfg, meta, identity)
    max_seq_len = cfg.max_seq_len or int(trained_with.get("loader", {}).get("max_seq_len", 2048))
    if max_seq_len - cfg.max_new_tokens < 1:
        raise ConfigError(
            f"RefineConfig.max_new_tokens = {cfg.max_new_tokens} leaves no room for "
            f"a prompt in max_seq_len = {max_seq_len}; lower --max-new-tokens or "
            "raise --max-seq-len"
        )
    train = round_train_config(cfg, meta, trained_with, supervised, k, max_seq_len)
    captured_aux = list(meta.captured_aux_layer_ids or meta.aux_layer_ids)
    return Plan(
        cfg,
        ck,
        meta,
        train,
        k,
        cfg.backend or "vllm",
        num_layers,
        [i for i in captured_aux if i != num_layers],
        list(meta.aux_layer_ids),
        identity,
        supervised,
        max_seq_len - cfg.max_new_tokens,
    )


def _check_data(cfg: RefineConfig) -> None:
    """Every data dir is an `eagle3 prepare` output."""
    for d in data_dirs(cfg.data):
        if not (d / PreparedMeta.FILE).is_file():
            raise ConfigError(
                f"RefineConfig.data: {d} is not a prepared dataset (no "
                f"{PreparedMeta.FILE}); pass --data with the `eagle3 prepare` "
                "output dir(s) "
                "of the training sources"
            )


def _supervised_capture(
    cfg: RefineConfig, meta: DraftMetadata, identity: dict[str, Any]
) -> str | None:
    """The capture dir(s) whose batches are mixed in (None when supervised_share is 0), checked
    to exist and to be of the same target."""
    if cfg.supervised_share <= 0:
        return None
    supervised = cfg.captured or meta.captured
    missing = [
        str(d) for d in data_dirs(supervised or "") if not (d / CaptureManifest.FILE).is_file()
    ]
    if not supervised or missing:
        raise ConfigError(
            f"RefineConfig.captured = {supervised!r}: no capture at {missing or supervised!r} "
            f"(supervised_share = {cfg.supervised_share} mixes supervised batches in); pass "
            "--captured CAPTURE_DIR with the draft's training capture, or --supervised-share 0"
        )
    check_target_identity(
        CaptureManifest.load_combined(supervised).recorded_target(),
        f"captured={supervised}",
        cfg.target,
        cfg.allow_target_mismatch,
        identity=identity,
    )
    return supervised


def round_train_config(
    cfg: RefineConfig,
    meta: DraftMetadata,
    trained_with: dict[str, Any],
    supervised: str | None,
    k: int,
    max_seq_len: int,
) -> TrainConfig:
    """Each round's training config: the checkpoint's own settings, but for refine's."""
    steps = cfg.steps_per_round
    trained_loader = trained_with.get("loader", {})
    trained_log_every = int(trained_with.get("checkpoint", {}).get("log_every", 10))
    round_settings = {
        "target": cfg.target,
        "captured": supervised or meta.captured,
        "vocab": cfg.vocab or meta.vocab,
        "out": None,
        "val_captured": None,
        "aux_layer_ids": list(meta.aux_layer_ids),
        "max_steps": steps,
        "num_speculative_tokens": k,
        "seed": cfg.seed,
        "device": cfg.device,
        "loader": {
            "max_seq_len": max_seq_len,
            "batch_size": cfg.batch_size or trained_loader.get("batch_size", 1),
            "verify_capture": False,
        },
        "loss": {"ttt_steps": max(int(meta.ttt_steps or 0), k), "weighting": cfg.loss_weighting},
        "optimizer": cfg.optimizer.model_dump(),
        "schedule": cfg.schedule.model_dump(),
        "checkpoint": {
            "eval_every": steps,
            "save_every": steps,
            "log_every": min(trained_log_every, steps),
            "resume": False,
            "ema_decay": 0.0,
        },
        "runtime": {"compile_cache": None},
    }
    return TrainConfig.model_validate(deep_merge(trained_with, round_settings))


def recorded_settings(meta: DraftMetadata) -> dict[str, Any]:
    """The training settings the checkpoint records (its TrainConfig, in groups), those this
    version still has: a record keeps every flag it was trained with, some since removed."""
    out: dict[str, Any] = {}
    for key, value in (meta.train_config or {}).items():
        if key in TRAIN_GROUPS and isinstance(value, dict):
            fields = TRAIN_GROUPS[key].model_fields
            out[key] = {k: v for k, v in value.items() if k in fields}
        elif key in TrainConfig.model_fields and key not in TRAIN_GROUPS:
            out[key] = value
    return out


def check_vocab(cfg: RefineConfig, meta: DraftMetadata, weights: Path) -> None:
    """An explicit --vocab must hold the checkpoint's own d2t (its head rows are in that order)."""
    if not cfg.vocab:
        return
    try:
        d2t, _ = DraftVocab.load(cfg.vocab).torch_maps()
    except FileNotFoundError as e:
        raise ConfigError(f"RefineConfig.vocab: {e}") from None
    own = read_d2t(weights.parent)
    if d2t.shape != own.shape or not torch.equal(d2t, own):
        raise ConfigError(
            f"RefineConfig.vocab = {cfg.vocab!r}: its d2t differs from the "
            f"checkpoint's ({weights}); pass the vocab the draft was trained with "
            f"({meta.vocab}) or leave --vocab unset"
        )


def read_d2t(ck: Path) -> torch.Tensor:
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("d2t").long()


@dataclass
class Prompts:
    """The training sources' prompts, split: validation (held out of every round) and each
    round's."""

    validation: list
    pool: list  # the training prompts the rounds draw from
    per_round: list[list]  # round r's prompts at index r - 1
    num_val: int
    num_found: int
    num_skipped: int


def plan_prompts(plan: Plan) -> Prompts:
    """The distinct prompts of cfg.data that fit, split into validation and rounds; a
    ConfigError when there are fewer than 2."""
    c = plan.cfg
    found = read_prompts(c.data, plan.max_prompt_tokens)
    if len(found.prompts) < 2:
        raise ConfigError(
            f"RefineConfig.data = {c.data!r}: {len(found.prompts)} distinct prompts "
            f"(skipped {found.skipped}); refine needs 2 or more (validation and "
            "training): pass more data, or a larger --max-seq-len for long prompts"
        )
    num_val = min(c.num_val_prompts, len(found.prompts) - 1)
    val_prompts, pool = split_prompts(found.prompts, num_val, c.seed)
    per_round = [round_prompts(pool, r, c.num_prompts) for r in range(1, c.rounds + 1)]
    return Prompts(val_prompts, pool, per_round, num_val, len(found.prompts), found.skipped)


def output_metadata(plan: Plan, step: int, metrics: dict, refine: dict[str, Any]) -> DraftMetadata:
    """eagle3_draft.json of a refined draft: the input's, its step and metrics, and `refine`."""
    return DraftMetadata.from_dict(
        {
            **plan.meta.to_dict(),
            "step": step,
            "metrics": metrics,
            "refine": {
                "from_checkpoint": str(plan.checkpoint.resolve()),
                "from_step": plan.meta.step,
                "num_speculative_tokens": plan.k,
                "config": plan.cfg.model_dump(mode="json"),
                **refine,
            },
        },
        "refine output",
    )
