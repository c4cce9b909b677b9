"""Read only what training needs from a target dir: its config and three tensors (embedding, final norm,
lm_head), without loading the model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


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


def load_vocab(vocab: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t (Vd,) long, t2d (V,) bool) from vocab.safetensors."""
    from safetensors.torch import load_file

    p = Path(vocab)
    p = p / "vocab.safetensors" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"vocab={vocab}: no vocab.safetensors; run `eagle3 vocab` first")
    t = load_file(str(p))
    return t["d2t"].long(), t["t2d"].bool()
