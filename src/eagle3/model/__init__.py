"""The EAGLE-3 draft model (one file: draft.py)."""

from eagle3.model.draft import (
    DraftConfig,
    DraftConfigError,
    Eagle3Draft,
    draft_config_from_target,
    expected_export_shapes,
    text_config,
)

__all__ = [
    "DraftConfig",
    "DraftConfigError",
    "Eagle3Draft",
    "draft_config_from_target",
    "expected_export_shapes",
    "text_config",
]
