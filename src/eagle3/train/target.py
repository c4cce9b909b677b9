"""For `train.init_layers_from_target`: the target's top decoder layers (read by eagle3.weights)
and the copy of them into a draft."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.config import ConfigError
from eagle3.model.draft import text_config
from eagle3.weights import load_target_layers, read_target_config


def load_top_layers(
    target: str | Path, num_draft_layers: int
) -> dict[int, dict[str, torch.Tensor]]:
    """The target's top num_draft_layers-1 layers (ids L-n+1 .. L-1), for
    init_layers_from_target."""
    L, n = text_config(read_target_config(target))["num_hidden_layers"], num_draft_layers
    if not 2 <= n <= L + 1:
        raise ConfigError(
            f"init_layers_from_target=true with draft.num_hidden_layers={n}: it needs 2 .. {L + 1} "
            f"(the target has {L} layers to copy after the draft's first)"
        )
    return load_target_layers(target, list(range(L - n + 1, L)))


def init_layers_from_target(
    model: torch.nn.Module, layers: dict[int, dict[str, torch.Tensor]], aux_ids: list[int] | None
) -> None:
    """Start an n-layer draft from the target's top n-1 layers (`layers`, ascending ids, as
    load_target_layers); aux_ids: the aux layer ids in the order fc reads them.

    layers.k <- target layer ids[k-1]; fc <- the identity on the deepest aux state (its block of
    fc's input); the midlayer's o_proj and down_proj <- 0, so it starts as the identity on the
    residual stream. With the final norm and lm_head from the target too, step 0 at row t then runs
    the target's top layers on its residual at the deepest aux id: exactly the target's next-token
    logits when that id is L-n+1. An MLP wider than the target's keeps the target's units first; the
    extra units' down_proj columns start at 0 (same function)."""
    cfg, ids = model.cfg, sorted(layers)
    if aux_ids is None or len(aux_ids) != cfg.num_aux:
        raise ConfigError(
            f"init_layers_from_target: aux ids {aux_ids} do not match the draft's {cfg.num_aux} "
            "aux states"
        )
    if len(ids) != cfg.num_hidden_layers - 1:
        raise ConfigError(
            f"init_layers_from_target: {len(ids)} target layers given for "
            f"{cfg.num_hidden_layers - 1} draft layers after the midlayer"
        )
    with torch.no_grad():
        H, Ht = cfg.hidden_size, cfg.target_hidden_size
        a = aux_ids.index(max(aux_ids)) * Ht  # the deepest aux state's columns in fc's input
        model.fc.weight.zero_()
        model.fc.weight[:, a : a + Ht].copy_(torch.eye(H, Ht))  # (H, A*Ht)
        model.midlayer.self_attn.o_proj.weight.zero_()
        model.midlayer.mlp.down_proj.weight.zero_()
        for k, i in enumerate(ids, start=1):
            own = dict(model.layers[str(k)].named_parameters())
            for name, w in layers[i].items():
                dst = own[name]
                if name.startswith("mlp.") and w.shape != dst.shape:
                    if (
                        name == "mlp.down_proj.weight"
                        and w.shape[0] == dst.shape[0]
                        and w.shape[1] <= dst.shape[1]
                    ):
                        dst.zero_()
                        dst[:, : w.shape[1]].copy_(w.float())  # (H, I_target) of (H, I_draft)
                        continue
                    if (
                        name != "mlp.down_proj.weight"
                        and w.shape[1] == dst.shape[1]
                        and w.shape[0] <= dst.shape[0]
                    ):
                        dst[: w.shape[0]].copy_(w.float())  # (I_target, H) of (I_draft, H)
                        continue
                if w.shape != dst.shape:
                    raise ConfigError(
                        f"train.init_layers_from_target=true: target layer {i} {name} has shape "
                        f"{tuple(w.shape)}, the draft's layers.{k}.{name} {tuple(dst.shape)}; "
                        "leave the draft's heads, KV heads and head_dim at the target's and its "
                        "intermediate_size >= the target's, or turn the option off"
                    )
                dst.copy_(w.float())
