"""Checks that keep a corrupt or foreign input from becoming a shipped draft.

- `nonfinite_tensors`: names of tensors holding NaN/inf (training refuses to save them, export to
  write them).
- `target_identity` / `check_target_identity`: which target a capture or a draft belongs to: the
  sha256 of its config.json, its layer count and the fingerprint of every weight file
  (eagle3.identity). A target with the same shapes but other decoder layers, another norm or a
  permuted lm_head trains and exports without any shape error, so regenerate, capture, train and
  export record these, and every stage that reads another's output compares them (capture's resume
  and evaluate included). Records from before 2026-12-03 hold a sha256 of the embedding, final norm
  and lm_head only: those are compared instead, with a warning (eagle3.artifacts).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import torch

from eagle3.artifacts import RecordedTarget, recorded_target_fingerprint
from eagle3.config import ConfigError
from eagle3.identity import config_sha256, describe_difference, target_fingerprint
from eagle3.io import read_json, sha256_file
from eagle3.model.draft import text_config
from eagle3.weights import load_target_tensors

#: the target tensors fingerprinted (as eagle3.weights.load_target_tensors names them)
FINGERPRINTED = ("embed", "norm", "lm_head")


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors in `tensors` that hold a NaN or an infinity."""
    return [
        k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())
    ]


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (CPU, as stored)."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def target_identity(
    target: str | Path, tensors: dict[str, torch.Tensor] | None = None
) -> dict[str, Any]:
    """{"target", "config_sha256", "config_file_sha256", "num_hidden_layers", "fingerprint"} of a
    target dir: `config_sha256` is eagle3.identity.config_sha256 (the content, whichever
    transformers version wrote it), `config_file_sha256` the file's bytes (what records from before
    2026-12-03 hold); `fingerprint` is eagle3.identity.target_fingerprint (every weight file; None
    for a config-only dir). The old fingerprint of embedding / norm / lm_head (`weights_sha256`) is
    added only when `tensors` (the load_target_tensors result) are given, or when a record from
    before 2026-12-03 needs it (legacy_weights_sha256)."""
    p = Path(target) / "config.json"
    out = {
        "target": str(target),
        "config_sha256": config_sha256(p),
        "config_file_sha256": sha256_file(p),
        "num_hidden_layers": text_config(read_json(p)).get("num_hidden_layers"),
        "fingerprint": target_fingerprint(target),
    }
    if tensors is not None:
        out["weights_sha256"] = {k: tensor_sha256(tensors[k]) for k in FINGERPRINTED}
    return out


def legacy_weights_sha256(actual: dict[str, Any]) -> dict[str, str] | None:
    """The embedding / final norm / lm_head sha256 of the target of `actual` (target_identity),
    read once; None when the target dir does not hold them (a config-only dir)."""
    if "weights_sha256" not in actual:
        try:
            tensors = load_target_tensors(actual["target"])
        except (FileNotFoundError, KeyError):
            tensors = None
        actual["weights_sha256"] = (
            None if tensors is None else {k: tensor_sha256(tensors[k]) for k in FINGERPRINTED}
        )
    return actual["weights_sha256"]


def identity_record(actual: dict[str, Any]) -> dict[str, Any]:
    """The fields a record (manifest, progress file, draft metadata) keeps of a target_identity."""
    return {
        "target_config_sha256": actual["config_sha256"],
        "target_fingerprint": actual["fingerprint"],
    }


def identity_mismatches(
    recorded: RecordedTarget, actual: dict[str, Any], what: str = "the record"
) -> list[str]:
    """What differs between a recorded identity (a capture manifest's or spool header's
    target_config_sha256, num_hidden_layers, target_fingerprint, or a draft's
    target_config_sha256, target_num_layers, target_fingerprint: their `recorded_target()`) and
    `actual` (target_identity). Fields the record lacks are not compared; a record from before
    2026-12-03 without `target_fingerprint` has its `target_weights_sha256` (embedding, norm,
    lm_head) compared instead, with a warning once (eagle3.artifacts). A recorded config sha256
    matches either the content hash or, for older records, the file's bytes. `what` names the
    record in that warning."""
    out = []
    config_now = (actual["config_sha256"], actual.get("config_file_sha256"))
    if recorded.config_sha256 is not None and recorded.config_sha256 not in config_now:
        out.append(
            f"config.json sha256 {recorded.config_sha256} (recorded) != {config_now[0]} (target)"
        )
    layers = recorded.num_hidden_layers
    if layers is not None and layers != actual["num_hidden_layers"]:
        out.append(
            f"num_hidden_layers {layers} (recorded) != {actual['num_hidden_layers']} (target)"
        )
    fp = recorded_target_fingerprint(recorded, what)
    if fp is not None:
        now_fp = actual["fingerprint"]  # None: a config-only dir, whose weights cannot be compared
        differs = describe_difference(fp, now_fp) if now_fp is not None else None
        if differs:
            out.append(differs)
        return out
    old = {k: v for k, v in (recorded.weights_sha256 or {}).items() if v is not None}
    now = legacy_weights_sha256(actual) if old else None
    for k, v in old.items():
        if now is not None and now.get(k) != v:
            out.append(
                f"{k} weights sha256 {v[:16]}... (recorded) != {now.get(k, '?')[:16]}... (target)"
            )
    return out


def check_target_identity(
    recorded: RecordedTarget,
    what: str,
    target: str | Path,
    allow: bool,
    *,
    identity: dict[str, Any] | None = None,
    error: type[Exception] = ConfigError,
    redo: str = "capture again with this one",
) -> dict[str, Any]:
    """The one check of a record against the target a stage was given: compares `recorded` (from
    `what`, e.g. "captured=DIR") with the target at `target` and returns the target's identity
    (`identity` when the caller has it already, else target_identity(target): pass it on to the
    next record's check). Every mismatch is named in one `error`, unless `allow` (the stage's
    allow_target_mismatch), which prints them as a warning instead. `redo`: the other way out."""
    if identity is None:
        identity = target_identity(target)
    bad = identity_mismatches(recorded, identity, what)
    if not bad:
        return identity
    made_from = recorded.target or "?"
    msg = (
        f"{what} was made from another target than target={target}: {'; '.join(bad)}. Use the "
        f"target it was made from ({made_from}), {redo}, or pass --allow-target-mismatch if this "
        "is intended (e.g. the same weights saved again)"
    )
    if not allow:
        raise error(msg)
    print(f"eagle3: warning (allow_target_mismatch=true): {msg}", file=sys.stderr, flush=True)
    return identity
