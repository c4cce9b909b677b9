"""What evaluate checks before an engine starts: the exported draft's files, the target it was
made for, and the chat template it was trained with."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eagle3.artifacts import DraftMetadata
from eagle3.chat_template import ChatRenderer
from eagle3.config import ConfigError, EvaluateConfig
from eagle3.integrity import check_target_identity, target_identity
from eagle3.io import corrupt_file_errors

log = logging.getLogger("eagle3.evaluate")


def read_json_config(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (a config.json, an eagle3_draft.json); ValueError naming it when
    it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def check_draft(draft: Path, k: int) -> dict[str, Any]:
    """The exported draft's config.json, after checking the directory holds it and readable
    weights."""
    cfg_path = draft / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(
            f"--draft {draft}: no config.json there; pass the directory `eagle3 export` wrote"
        )
    try:
        dcfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    if not any(draft.glob("*.safetensors")):
        raise FileNotFoundError(
            f"--draft {draft}: no *.safetensors weights; re-run `eagle3 export`"
        )
    _check_weight_files(draft)
    return dcfg


def _check_weight_files(draft: Path) -> None:
    """Read every weight file's safetensors header (and check the file holds what it declares)
    before an engine starts: a truncated or overwritten file is named here, not in vLLM's loader ~80
    lines of traceback later."""
    fix = f"export the draft again (`eagle3 export --checkpoint TRAIN_OUT --out {draft}`)"
    for f in sorted(draft.glob("*.safetensors")):
        with corrupt_file_errors(f, "draft weights", fix), safe_open(str(f), "pt") as st:
            list(st.keys())


def check_draft_target(cfg: EvaluateConfig, draft: Path | None) -> dict[str, Any]:
    """The target's identity (eagle3.integrity.target_identity), after comparing it with the one
    the exported draft records (its eagle3_draft.json): a draft served with another target than it
    was trained for proposes what that target would not say, and τ measures nothing useful. A
    mismatch is a ConfigError naming both, unless cfg.allow_target_mismatch (a warning). A draft not
    exported by eagle3 (no eagle3_draft.json) is not compared."""
    meta_path = draft / DraftMetadata.FILE if draft is not None else None
    if meta_path is None:
        return target_identity(cfg.target)
    if not meta_path.is_file():
        log.warning(
            "evaluate: %s has no eagle3_draft.json (not exported by eagle3 export): the "
            "target it was made for cannot be compared with --target %s",
            draft,
            cfg.target,
        )
        return target_identity(cfg.target)
    meta = DraftMetadata.from_dict(read_json_config(meta_path), str(meta_path))
    return check_target_identity(
        meta.recorded_target(),
        f"draft {draft}",
        cfg.target,
        cfg.allow_target_mismatch,
        redo="export a draft trained for this one",
    )


def check_chat_template(
    cfg: EvaluateConfig, draft: Path | None, renderer: ChatRenderer
) -> dict[str, Any]:
    """How the prompts are rendered (results.json `chat`), after comparing the run's
    chat_template_kwargs with those the draft was trained with: a draft trained thinking on and
    evaluated thinking off (or the reverse) is refused, unless allow_chat_template_mismatch,
    which labels the results instead (`chat.mismatch`)."""
    chat = {**renderer.identity(), "draft_chat_template_kwargs": None, "mismatch": False}
    meta_path = draft / DraftMetadata.FILE if draft is not None else None
    if meta_path is None or not meta_path.is_file():
        return chat
    meta = DraftMetadata.from_dict(read_json_config(meta_path), str(meta_path))
    trained = meta.chat_template_kwargs
    chat["draft_chat_template_kwargs"] = trained
    if trained is None or trained == chat["chat_template_kwargs"]:
        return chat
    message = (
        f"draft {draft} was trained on data rendered with chat_template_kwargs = {trained}, "
        f"but evaluate renders the prompts with {chat['chat_template_kwargs']}"
    )
    if not cfg.allow_chat_template_mismatch:
        raise ConfigError(
            f"{message}: set evaluate.chat_template_kwargs (or the pipeline's top-level "
            "chat_template_kwargs) to what the draft was trained with, or pass "
            "--allow-chat-template-mismatch to measure it anyway (results.json is labelled)"
        )
    log.warning("evaluate: %s (allowed; results.json says so under chat.mismatch)", message)
    chat["mismatch"] = True
    return chat
