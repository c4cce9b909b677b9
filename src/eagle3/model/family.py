"""Draft families: the one protocol a kind of draft meets, and the registry the stages take it from.

A family says how a draft's shape follows from the target (and train.draft), builds the torch module
that trains, and writes the config.json vLLM loads with the speculative method vLLM serves it by.
The trainer, refine, export and evaluate never name a family's classes: they look it up by the name
train.draft.family gives and every eagle3_draft.json records (`draft_config.family`).

    eagle3     EAGLE-3                            eagle3.model.eagle3
    eagle3.1   EAGLE-3.1 (fc_norm, norm_output)   eagle3.model.eagle31

A family of the package is a folder eagle3/model/<name>/ whose `__init__` defines FAMILY, listed in
BUILTIN_FAMILIES (imported on first use); one from elsewhere (a plug-in, a test) calls
register_family(obj) in the process that trains, exports or evaluates it. Families never import
each other (pyproject.toml, contract draft-families-independent): what two share sits here in
eagle3.model (the EAGLE architecture both built-in families build: eagle3.model.eagle).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from eagle3.model.draft import DraftConfigError

if TYPE_CHECKING:
    import torch

    from eagle3.model.draft import AttnFn, DraftConfig

#: family name -> the module whose FAMILY it is
BUILTIN_FAMILIES: dict[str, str] = {
    "eagle3": "eagle3.model.eagle3",
    "eagle3.1": "eagle3.model.eagle31",
}


class DraftModel(Protocol):
    """What training (eagle3.train.step), the offline replay (eagle3.train.estimate) and export
    call on a draft: a torch.nn.Module with these members."""

    cfg: DraftConfig
    embed_tokens: torch.nn.Embedding  # the target's, frozen
    lm_head: torch.nn.Linear  # hidden -> draft vocabulary
    norm: torch.nn.Module  # the final norm before lm_head
    d2t: torch.Tensor  # draft id -> target id offset
    t2d: torch.Tensor  # target ids the draft vocabulary holds

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states (B, T, n_aux * H_target) -> the first step's hidden (B, T, H)."""

    def new_cache(self) -> list:
        """An empty key/value cache for one unrolled TTT forward."""

    def step(
        self, input_ids, hidden, positions, cache, attn_fn: AttnFn, states: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step: (normed output for lm_head, hidden for the next step)."""

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """lm_head over the draft vocabulary."""

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights a served draft holds, under the names the served model loads."""

    def compile_blocks(self, mode: str = "layer") -> None:
        """torch.compile what runs once per TTT step."""


class DraftFamily(Protocol):
    """A kind of draft model (module docstring)."""

    #: the registry key; train.draft.family and eagle3_draft.json's draft_config.family
    name: str
    #: vLLM's speculative_config["method"] that serves an exported draft of this family
    vllm_method: str
    #: the `eagle3 export --format` values it writes (eagle3.config.ExportConfig.format)
    export_formats: tuple[str, ...]

    def draft_config(
        self, target_cfg: dict[str, Any], num_aux: int, draft_vocab_size: int, options: Any
    ) -> DraftConfig:
        """The draft's shape for this target, `num_aux` aux states and the draft vocabulary;
        `options` (eagle3.config.train_options.DraftOptions) overrides dimensions. Its `family` is
        this family's name."""

    def build(self, cfg: DraftConfig) -> DraftModel:
        """A draft of shape `cfg` (weights initialised at random; on the meta device under
        `torch.device("meta")`, where export reads the shapes a checkpoint must hold)."""

    def export_config(
        self, cfg: DraftConfig, aux_layer_ids: list[int], fmt: str, verifier: dict[str, Any]
    ) -> dict[str, Any]:
        """config.json of an exported draft in format `fmt` (one of export_formats); `verifier`:
        the target's path and architectures (`name_or_path`, `architectures`)."""


#: the families registered in this process, by name (built-in ones once first used)
REGISTERED: dict[str, DraftFamily] = {}


def register_family(family: DraftFamily) -> DraftFamily:
    """Make `family` known by its name in this process; a DraftConfigError when the name is a
    built-in family's or another registered family's."""
    taken = REGISTERED.get(family.name)
    if family.name in BUILTIN_FAMILIES or (taken is not None and taken is not family):
        raise DraftConfigError(
            f"draft family {family.name!r} is taken (by "
            f"{BUILTIN_FAMILIES.get(family.name) or type(taken).__name__}); give the new family "
            "another name"
        )
    REGISTERED[family.name] = family
    return family


def get_family(name: str) -> DraftFamily:
    """The family registered as `name` (a built-in one: its module's FAMILY, imported on first
    use); a DraftConfigError naming the known ones otherwise."""
    if name not in REGISTERED and name in BUILTIN_FAMILIES:
        REGISTERED[name] = importlib.import_module(BUILTIN_FAMILIES[name]).FAMILY
    if name not in REGISTERED:
        raise DraftConfigError(
            f"draft family {name!r} is not registered; known: {', '.join(family_names())} "
            "(train.draft.family; a family of another package registers itself with "
            "eagle3.model.family.register_family before the stage runs)"
        )
    return REGISTERED[name]


def family_names() -> list[str]:
    """Every family known in this process: the built-in ones and those registered."""
    return sorted(set(BUILTIN_FAMILIES) | set(REGISTERED))


__all__ = [
    "BUILTIN_FAMILIES",
    "DraftFamily",
    "DraftModel",
    "family_names",
    "get_family",
    "register_family",
]
