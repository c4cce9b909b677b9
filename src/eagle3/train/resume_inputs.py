"""What a checkpoint records of the run that wrote it, and how a resumed run is compared with it.

Every checkpoint's eagle3_draft.json (eagle3.train.checkpoint.draft_metadata) holds `train_config`
(every setting), `draft_config` (the draft's shape) and `inputs`: the identities of what it was
trained on (the capture's content, the vocab's d2t/t2d, the validation capture, the target's weights
and config). Resume compares them with the new run's before it loads any weight (`check_resume`) and
refuses a difference, naming each field with its old and new value. RESUME_RULES says, for every
TrainConfig setting (a group's by its dotted name, `optimizer.lr`), what may change:

    same   never, not even with --checkpoint-force-resume: the checkpoint's weights, optimizer
           state or data position mean something else under another value (seed and
           loader.val_fraction pick the train/validation split and the epoch order the loader
           position counts in; draft.freeze changes the optimizer's parameter list)
    force  with checkpoint.force_resume (a warning lists them; the new values apply from the
           resumed step on)
    free   any time: no effect on the weights (logging, checkpoint cadence, workers, the init_*
           settings, which act at step 0 only), compared by content instead of by path (target,
           captured, vocab, val_captured, draft: the `inputs` and the draft shape), or checked by
           eagle3.train.loop.check_layout instead (parallel, batch_size, grad_accum: a checkpoint
           resumes at any world size and wrapping with the same packed rows per optimizer step)

The draft's shape (`draft_config` minus dropout, a `force` setting) and the inputs other than the
validation capture are `same`. Checkpoints written before 2026-12-03 have no `inputs`:
eagle3.artifacts warns once and the config and draft shape are compared.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from eagle3.artifacts import DraftMetadata
from eagle3.config import ConfigError, TrainConfig
from eagle3.config.train_options import DRAFT_SHAPE_FIELDS, TRAIN_GROUPS

SAME, FORCE, FREE = "same", "force", "free"

SAME_FIELDS = ("seed", "loader.val_fraction", "aux_layer_ids", "draft.freeze")
FORCE_FIELDS = (
    "optimizer.lr",
    "schedule.min_lr_ratio",
    "schedule.decay",
    "schedule.warmup_steps",
    "optimizer.weight_decay",
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.grad_clip",
    "epochs",
    "max_steps",
    "loss.ttt_steps",
    "loss.decay",
    "loader.max_seq_len",
    "runtime.dtype",
    "loss.supervise",
    "loader.hidden_noise",
    "loss.feature_weight",
    "loss.midlayer_feature_weight",
    "loss.distill_temperature",
    "loss.copy_weight",
    "draft.dropout",
    "checkpoint.ema_decay",
    "num_speculative_tokens",
    "loss.weighting",
)
#: the draft's family and dimensions: compared as the draft's shape (`draft_config`) instead
DRAFT_SHAPE = tuple(f"draft.{k}" for k in ("family", *DRAFT_SHAPE_FIELDS))
FREE_FIELDS = (
    "target",
    "captured",
    "vocab",
    "val_captured",
    *DRAFT_SHAPE,
    "out",  # compared by content instead
    "checkpoint.eval_every",
    "checkpoint.save_every",
    "checkpoint.log_every",
    "device",
    "runtime.attention",
    "runtime.compile",
    "runtime.compile_cache",
    "draft.init_head_from_target",
    "draft.init_layers_from_target",
    "loader.num_workers",
    "loader.preload",
    "checkpoint.resume",
    "loader.verify_capture",
    "optimizer.max_nonfinite_steps",
    "allow_target_mismatch",
    "checkpoint.force_resume",
    "checkpoint.keep",
    "runtime.parallel",
    "loader.batch_size",
    "loader.grad_accum",  # rows per optimizer step: check_layout
)
#: TrainConfig setting (dotted: `optimizer.lr`) -> same / force / free (module docstring); a test
#: keeps it complete
RESUME_RULES: dict[str, str] = {
    **dict.fromkeys(SAME_FIELDS, SAME),
    **dict.fromkeys(FORCE_FIELDS, FORCE),
    **dict.fromkeys(FREE_FIELDS, FREE),
}

#: `inputs` keys (draft_metadata) -> (name in messages, rule)
INPUT_RULES: dict[str, tuple[str, str]] = {
    "captured_sha256": ("captured (content)", SAME),
    "vocab_sha256": ("vocab (d2t/t2d)", SAME),
    "target_config_sha256": ("target config.json", SAME),
    "target_weights_sha256": ("target weights", SAME),
    "val_captured_sha256": ("val_captured (content)", FORCE),
}


def settings(train_config: dict[str, Any] | None) -> dict[str, Any]:
    """A recorded TrainConfig as {dotted setting: value} (`optimizer.lr`: its groups flattened);
    eagle3.artifacts has put an older, flat record into groups already."""
    out: dict[str, Any] = {}
    for key, value in (train_config or {}).items():
        if key in TRAIN_GROUPS and isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def _show(v: Any) -> str:
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12] + "..."  # a sha256
    return repr(v) if isinstance(v, str) else str(v)


def resume_differences(
    old: DraftMetadata | None, new: DraftMetadata, what: str
) -> list[tuple[str, str, str]]:
    """[(rule, field, "field old -> new")] between the checkpoint's metadata `old` and the new
    run's `new` (both draft_metadata records), the ones no flag can override first; `what` names the
    checkpoint in the warning about older checkpoints; a checkpoint without one (`old` None) is
    not compared."""
    if old is None:
        return []
    out = []
    old_inputs = old.recorded_resume_inputs(what)
    if old_inputs is not None:
        new_inputs = new.inputs or {}
        for key, (name, rule) in INPUT_RULES.items():
            a, b = old_inputs.get(key), new_inputs.get(key)
            if key == "target_config_sha256" and a == new_inputs.get("target_config_file_sha256"):
                continue  # a checkpoint from before 2026-12-03 recorded the file's bytes
            if a != b:
                out.append((rule, name, f"{name} {_show(a)} -> {_show(b)}"))
    old_shape, new_shape = dict(old.draft_config or {}), dict(new.draft_config)
    for key in sorted(set(old_shape) | set(new_shape)):
        if key != "dropout" and old_shape and old_shape.get(key) != new_shape.get(key):
            shown = f"{key} {_show(old_shape.get(key))} -> {_show(new_shape.get(key))}"
            out.append((SAME, key, shown))
    old_cfg, new_cfg = settings(old.train_config), settings(new.train_config)
    for key, rule in RESUME_RULES.items():
        if rule != FREE and key in old_cfg and old_cfg[key] != new_cfg.get(key):
            out.append((rule, key, f"{key} {_show(old_cfg[key])} -> {_show(new_cfg.get(key))}"))
    return sorted(out, key=lambda d: d[0] != SAME)


def check_resume(
    cfg: TrainConfig, ckpt: Path, old: DraftMetadata | None, new: DraftMetadata
) -> None:
    """Refuse (ConfigError) to resume `ckpt`, whose eagle3_draft.json is `old`, into a run whose
    metadata would be `new`, when they differ beyond what RESUME_RULES allows; with force_resume
    the `force` differences are printed as a warning and resume goes on."""
    diffs = resume_differences(old, new, str(ckpt / DraftMetadata.FILE))
    if not diffs:
        return
    listed = "; ".join(d for _, _, d in diffs)
    never = [f for rule, f, _ in diffs if rule == SAME]
    head = f"resume from {ckpt}: this run differs from the one that wrote the checkpoint: {listed}."
    if never:
        raise ConfigError(
            f"{head} --checkpoint-force-resume cannot resume over {', '.join(never)} (the "
            "checkpoint's weights, optimizer state or data position would mean something else): "
            "train into a new --out, set checkpoint.resume: false to start over in this one, or "
            "put back the values it was trained with"
        )
    if not cfg.checkpoint.force_resume:
        raise ConfigError(
            f"{head} These may change mid-run: pass --checkpoint-force-resume "
            "(checkpoint.force_resume: true) to resume with the new values, or put back the old "
            "ones"
        )
    print(
        f"eagle3: warning (checkpoint.force_resume=true): resuming {ckpt} with other settings: "
        f"{listed}",
        file=sys.stderr,
        flush=True,
    )


__all__ = ["RESUME_RULES", "INPUT_RULES", "check_resume", "resume_differences"]
