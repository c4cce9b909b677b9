"""Records written by earlier versions, read as today's: the one place that migrates them.

Old key names. The aux layer ids (vLLM EAGLE-3 semantics: id k = output of decoder layer k-1) went
by several names; they are `aux_layer_ids` everywhere now: in configs (capture/train sections),
capture manifests and spool headers, and a draft's eagle3_draft.json (its `train_config` too). Only
the exported config.json keeps vLLM's own key `eagle_aux_hidden_state_layer_ids`. Files on disk with
the old keys still load: every reader passes what it read through `migrate_record`. A user config
with an old key is an error naming the new key (eagle3.config), not a silent alias, so the YAML gets
fixed once.

Target identity (2026-12-03). Capture manifests, progress files, spool headers and draft metadata
record `target_fingerprint` (eagle3.identity: every weight file). Older ones identify the target by
the embedding, final norm and lm_head only (`target_weights_sha256`): `recorded_target_fingerprint`
warns once per record and the readers compare those instead. Checkpoints record their `inputs`
(capture, vocab, ... identities) since the same date; for older ones `recorded_resume_inputs` warns
once and resume compares the config and draft shape only.
"""

from __future__ import annotations

import sys
from typing import Any

_warned: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Print `message` as an eagle3 warning the first time `key` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        print(f"eagle3: warning: {message}", file=sys.stderr, flush=True)

#: old key -> new key, in capture manifests, spool headers and draft metadata
RENAMED_RECORD_KEYS: dict[str, str] = {
    "layers": "aux_layer_ids",
    "captured_layers": "captured_aux_layer_ids",
}

#: old key -> new key, in the capture: and train: sections of a config (and the stage configs)
RENAMED_CONFIG_KEYS: dict[str, str] = {"layers": "aux_layer_ids"}


def migrate_record(record: dict[str, Any]) -> dict[str, Any]:
    """A copy of a capture manifest, spool header or draft metadata with the old key names renamed (a record that
    holds both names keeps the new one); its nested `train_config` is migrated the same way."""
    out = dict(record)
    for old, new in RENAMED_RECORD_KEYS.items():
        if old in out:
            value = out.pop(old)
            out.setdefault(new, value)
    if isinstance(out.get("train_config"), dict):
        tc = dict(out["train_config"])
        for old, new in RENAMED_CONFIG_KEYS.items():
            if old in tc:
                tc.setdefault(new, tc.pop(old))
        out["train_config"] = tc
    return out


def recorded_target_fingerprint(record: dict[str, Any], what: str) -> dict[str, Any] | None:
    """The `target_fingerprint` a record (`what`: its file, for the message) holds; None, with a
    warning once per record, for one written before 2026-12-03, whose readers then compare its
    `target_weights_sha256` (embedding, final norm, lm_head) instead."""
    fp = record.get("target_fingerprint")
    if fp:
        return fp
    old = ("the embedding, final norm and lm_head sha256" if record.get("target_weights_sha256")
           else "no weights")
    warn_once(f"fingerprint:{what}", f"{what} was written before 2026-12-03 and records no "
              f"fingerprint of the target's weight files; only {old} can be compared (decoder "
              "layers changed in place go unnoticed). Produce it again with this version to have "
              "every weight checked")
    return None


def recorded_resume_inputs(meta: dict[str, Any], what: str) -> dict[str, Any] | None:
    """The `inputs` (capture, vocab, target identities) a checkpoint's eagle3_draft.json records;
    None, with a warning once, for a checkpoint written before 2026-12-03 (resume then compares its
    config and draft shape only)."""
    if isinstance(meta.get("inputs"), dict):
        return meta["inputs"]
    warn_once(f"inputs:{what}", f"{what} was written before 2026-12-03 and records no identity of "
              "the capture and vocab it was trained on; resume compares its training config and "
              "draft shape only")
    return None
