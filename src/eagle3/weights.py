"""Read what the stages need from a target dir without loading the model: its config and three
tensors (embedding, final norm, lm_head: training's target head, capture's and export's identity
fingerprint, the speculators export's embedding), and the weights of whole decoder layers
(`train.init_layers_from_target`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.config import ConfigError


def read_target_config(target: str | Path) -> dict[str, Any]:
    p = Path(target) / "config.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"target={target}: no config.json there; pass a local HF model directory"
        )
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
    """{'embed': (V, Ht), 'norm': (Ht,), 'lm_head': (V, Ht)}; lm_head falls back to the embedding
    when tied."""
    target = Path(target)
    names = _weight_files(target)
    keys = {
        "embed": _find(
            names, ["model.embed_tokens.weight", "embed_tokens.weight"], "embedding", target
        ),
        "norm": _find(
            names,
            ["model.norm.weight", "language_model.norm.weight", "norm.weight"],
            "final norm",
            target,
        ),
        "lm_head": _find(names, ["lm_head.weight"], "lm_head", target),
    }
    if keys["lm_head"] is None:
        keys["lm_head"] = keys["embed"]  # tie_word_embeddings
    for k, v in keys.items():
        if v is None:
            raise KeyError(
                f"target={target}: could not find the {k} weight among {len(names)} tensors"
            )
    out = {}
    for k, name in keys.items():
        with safe_open(str(names[name]), "pt") as h:
            out[k] = h.get_tensor(name)
    return out


#: What a dense Llama-style decoder layer holds, under the draft's (= transformers') names.
LAYER_KEYS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def load_target_layers(
    target: str | Path, layer_ids: list[int]
) -> dict[int, dict[str, torch.Tensor]]:
    """{layer id: {LAYER_KEYS name: tensor}} for these decoder layers of the target; refuses
    layers the draft's plain Llama layer cannot copy (q/k norms, biases, MoE or MLA weights)."""
    target = Path(target)
    names = _weight_files(target)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in layer_ids:
        anchor = f"layers.{i}.self_attn.q_proj.weight"
        hits = [
            k
            for k in names
            if (k == anchor or k.endswith("." + anchor)) and "vision" not in k and "mtp" not in k
        ]
        prefix = min(hits, key=len)[: -len("self_attn.q_proj.weight")] if hits else None
        missing = [k for k in LAYER_KEYS if prefix is None or prefix + k not in names]
        extra = [
            k
            for k in names
            if prefix and k.startswith(prefix) and k[len(prefix) :] not in LAYER_KEYS
        ]
        if missing or extra:
            raise ConfigError(
                f"train.init_layers_from_target=true: target={target} layer {i} is not a dense "
                f"Llama-style layer (missing {missing[:3]}, unexpected {extra[:3]}); the draft's "
                "layers can only start from plain attention + SwiGLU layers, so set "
                "init_layers_from_target=false for this target"
            )
        out[i] = {}
        for k in LAYER_KEYS:
            with safe_open(str(names[prefix + k]), "pt") as h:
                out[i][k] = h.get_tensor(prefix + k)
    return out
