"""Read only what training needs from a target dir: its config and three tensors (embedding, final norm,
lm_head), without loading the model; for `train.init_layers_from_target`, its top decoder layers and the copy of
them into a draft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.config import ConfigError
from eagle3.model.draft import text_config


def read_target_config(target: str | Path) -> dict[str, Any]:
    p = Path(target) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(f"target={target}: no config.json there; pass a local HF model directory")
    return json.loads(p.read_text())


def _weight_files(target: Path) -> dict[str, Path]:
    """tensor name -> safetensors file."""
    index = target / "model.safetensors.index.json"
    if index.is_file():
        return {k: target / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    files = sorted(target.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"target={target}: no *.safetensors weights found")
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            out.update({k: f for k in h.keys()})
    return out


def _find(names: dict[str, Path], suffixes: list[str], what: str, target: Path) -> str | None:
    for suf in suffixes:
        hits = [k for k in names if k == suf or k.endswith("." + suf)]
        hits = [k for k in hits if "vision" not in k and "visual" not in k and "mtp" not in k]
        if hits:
            return min(hits, key=len)
    return None


def load_target_tensors(target: str | Path) -> dict[str, torch.Tensor]:
    """{'embed': (V, Ht), 'norm': (Ht,), 'lm_head': (V, Ht)}; lm_head falls back to the embedding when tied."""
    target = Path(target)
    names = _weight_files(target)
    keys = {
        "embed": _find(names, ["model.embed_tokens.weight", "embed_tokens.weight"], "embedding", target),
        "norm": _find(names, ["model.norm.weight", "language_model.norm.weight", "norm.weight"], "final norm", target),
        "lm_head": _find(names, ["lm_head.weight"], "lm_head", target),
    }
    if keys["lm_head"] is None:
        keys["lm_head"] = keys["embed"]  # tie_word_embeddings
    for k, v in keys.items():
        if v is None:
            raise KeyError(f"target={target}: could not find the {k} weight among {len(names)} tensors")
    out = {}
    for k, name in keys.items():
        with safe_open(str(names[name]), "pt") as h:
            out[k] = h.get_tensor(name)
    return out


#: What a dense Llama-style decoder layer holds, under the draft's (= transformers') names.
LAYER_KEYS = (
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def load_target_layers(target: str | Path, layer_ids: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """{layer id: {LAYER_KEYS name: tensor}} for these decoder layers of the target; refuses layers the draft's
    plain Llama layer cannot copy (q/k norms, biases, MoE or MLA weights)."""
    target = Path(target)
    names = _weight_files(target)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in layer_ids:
        anchor = f"layers.{i}.self_attn.q_proj.weight"
        hits = [k for k in names if (k == anchor or k.endswith("." + anchor)) and "vision" not in k and "mtp" not in k]
        prefix = min(hits, key=len)[: -len("self_attn.q_proj.weight")] if hits else None
        missing = [k for k in LAYER_KEYS if prefix is None or prefix + k not in names]
        extra = [k for k in names if prefix and k.startswith(prefix) and k[len(prefix):] not in LAYER_KEYS]
        if missing or extra:
            raise ConfigError(
                f"train.init_layers_from_target=true: target={target} layer {i} is not a dense Llama-style layer "
                f"(missing {missing[:3]}, unexpected {extra[:3]}); the draft's layers can only start from plain "
                "attention + SwiGLU layers, so set init_layers_from_target=false for this target"
            )
        out[i] = {}
        for k in LAYER_KEYS:
            with safe_open(str(names[prefix + k]), "pt") as h:
                out[i][k] = h.get_tensor(prefix + k)
    return out


def load_top_layers(target: str | Path, num_draft_layers: int) -> dict[int, dict[str, torch.Tensor]]:
    """The target's top num_draft_layers-1 layers (ids L-n+1 .. L-1), for init_layers_from_target."""
    L, n = text_config(read_target_config(target))["num_hidden_layers"], num_draft_layers
    if not 2 <= n <= L + 1:
        raise ConfigError(f"init_layers_from_target=true with draft.num_hidden_layers={n}: it needs 2 .. {L + 1} "
                          f"(the target has {L} layers to copy after the draft's first)")
    return load_target_layers(target, list(range(L - n + 1, L)))


def init_layers_from_target(model: torch.nn.Module, layers: dict[int, dict[str, torch.Tensor]],
                            aux_ids: list[int] | None) -> None:
    """Start an n-layer draft from the target's top n-1 layers (`layers`, ascending ids, as load_target_layers);
    aux_ids: the aux layer ids in the order fc reads them.

    layers.k <- target layer ids[k-1]; fc <- the identity on the deepest aux state (its block of fc's input); the
    midlayer's o_proj and down_proj <- 0, so it starts as the identity on the residual stream. With the final
    norm and lm_head from the target too, step 0 at row t then runs the target's top layers on its residual at the
    deepest aux id: exactly the target's next-token logits when that id is L-n+1. An MLP wider than the target's
    keeps the target's units first; the extra units' down_proj columns start at 0 (same function)."""
    cfg, ids = model.cfg, sorted(layers)
    if aux_ids is None or len(aux_ids) != cfg.num_aux:
        raise ConfigError(f"init_layers_from_target: aux ids {aux_ids} do not match the draft's {cfg.num_aux} aux states")
    if len(ids) != cfg.num_hidden_layers - 1:
        raise ConfigError(f"init_layers_from_target: {len(ids)} target layers given for {cfg.num_hidden_layers - 1} "
                          "draft layers after the midlayer")
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
                    if name == "mlp.down_proj.weight" and w.shape[0] == dst.shape[0] and w.shape[1] <= dst.shape[1]:
                        dst.zero_()
                        dst[:, : w.shape[1]].copy_(w.float())  # (H, I_target) of (H, I_draft)
                        continue
                    if name != "mlp.down_proj.weight" and w.shape[1] == dst.shape[1] and w.shape[0] <= dst.shape[0]:
                        dst[: w.shape[0]].copy_(w.float())  # (I_target, H) of (I_draft, H)
                        continue
                if w.shape != dst.shape:
                    raise ConfigError(
                        f"train.init_layers_from_target=true: target layer {i} {name} has shape {tuple(w.shape)}, the "
                        f"draft's layers.{k}.{name} {tuple(dst.shape)}; leave the draft's heads, KV heads and head_dim "
                        "at the target's and its intermediate_size >= the target's, or turn the option off"
                    )
                dst.copy_(w.float())

