"""Checks that keep a corrupt or foreign input from becoming a shipped draft.

- `nonfinite_tensors`: names of tensors holding NaN/inf (training refuses to save them, export to write them).
- `target_identity` / `check_target_identity`: which target a capture or a draft belongs to: the sha256 of its
  config.json, its layer count and a sha256 of the three tensors training reads from it (embedding, final norm,
  lm_head). A target with the same hidden size but other layers, another norm or a permuted lm_head trains and
  exports without any shape error, so capture records these, and train and export compare them.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import torch

from eagle3.artifacts import RecordedTarget
from eagle3.io import read_json, sha256_file
from eagle3.model.draft import text_config
from eagle3.weights import load_target_tensors

#: the target tensors fingerprinted (as eagle3.weights.load_target_tensors names them)
FINGERPRINTED = ("embed", "norm", "lm_head")


def nonfinite_tensors(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors in `tensors` that hold a NaN or an infinity."""
    return [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of a tensor's dtype, shape and bytes (CPU, as stored)."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def target_identity(target: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """{"config_sha256", "num_hidden_layers", "weights_sha256": {embed, norm, lm_head}} of a target dir.
    `tensors`: the load_target_tensors result when the caller has it already (not read again)."""
    p = Path(target) / "config.json"
    if tensors is None:
        try:
            tensors = load_target_tensors(target)
        except (FileNotFoundError, KeyError):  # a config-only target dir (export needs no weights): not compared
            tensors = None
    return {
        "config_sha256": sha256_file(p),
        "num_hidden_layers": text_config(read_json(p)).get("num_hidden_layers"),
        "weights_sha256": None if tensors is None else {k: tensor_sha256(tensors[k]) for k in FINGERPRINTED},
    }


def identity_mismatches(recorded: RecordedTarget, actual: dict[str, Any]) -> list[str]:
    """What differs between a recorded identity (a capture manifest's or spool header's
    target_config_sha256, num_hidden_layers, target_weights_sha256, or a draft's
    target_config_sha256, target_num_layers, target_weights_sha256: their `recorded_target()`)
    and `actual` (target_identity). Fields the record lacks (older captures) are not compared."""
    out = []
    pairs = ((recorded.config_sha256, "config_sha256", "config.json sha256"),
             (recorded.num_hidden_layers, "num_hidden_layers", "num_hidden_layers"))
    for value, akey, name in pairs:
        if value is not None and value != actual[akey]:
            out.append(f"{name} {value} (recorded) != {actual[akey]} (target)")
    for k, v in (recorded.weights_sha256 or {}).items():
        if v is not None and actual["weights_sha256"] is not None and actual["weights_sha256"].get(k) != v:
            out.append(f"{k} weights sha256 {v[:16]}... (recorded) != {actual['weights_sha256'].get(k, '?')[:16]}... (target)")
    return out


def check_target_identity(recorded: RecordedTarget, actual: dict[str, Any], *, what: str,
                          target: str | Path,
                          allow: bool, error: type[Exception]) -> None:
    """Raise `error` naming every mismatch between `recorded` (from `what`) and the target at `target`, unless
    `allow` (the override flag), which prints them as a warning instead."""
    bad = identity_mismatches(recorded, actual)
    if not bad:
        return
    made_from = recorded.target or "?"
    msg = (f"{what} was made from another target than target={target}: {'; '.join(bad)}. Use the target it was "
           f"made from ({made_from}), capture again with this one, or pass --allow-target-mismatch if this is "
           "intended (e.g. the same weights saved again)")
    if not allow:
        raise error(msg)
    print(f"eagle3: warning (allow_target_mismatch=true): {msg}", file=sys.stderr, flush=True)
