"""Draft models: the families behind one protocol and registry (family.py), the EAGLE architecture
the built-in families share (draft.py, eagle.py), one folder per family (eagle3/, eagle31/)."""

from eagle3.model.draft import (
    DraftConfig,
    DraftConfigError,
    draft_config_from_target,
    text_config,
)
from eagle3.model.family import (
    DraftFamily,
    DraftModel,
    family_names,
    get_family,
    register_family,
)

__all__ = [
    "DraftConfig",
    "DraftConfigError",
    "DraftFamily",
    "DraftModel",
    "draft_config_from_target",
    "family_names",
    "get_family",
    "register_family",
    "text_config",
]
