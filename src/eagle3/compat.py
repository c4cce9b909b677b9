"""Old key names of files written before 2026-12-01, read as aliases: the one place that migrates them.

The aux layer ids (vLLM EAGLE-3 semantics: id k = output of decoder layer k-1) went by several names; they are
`aux_layer_ids` everywhere now: in configs (capture/train sections), capture manifests and spool headers, and a
draft's eagle3_draft.json (its `train_config` too). Only the exported config.json keeps vLLM's own key
`eagle_aux_hidden_state_layer_ids`. Files on disk with the old keys still load: every reader passes what it read
through `migrate_record`. A user config with an old key is an error naming the new key (eagle3.config), not a
silent alias, so the YAML gets fixed once.
"""

from __future__ import annotations

from typing import Any

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
