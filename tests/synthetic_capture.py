"""Test helpers: captured-sample dicts from a small transformers target, and a vocab dir.

Not used by training itself; the real inputs come from `eagle3 capture` and `eagle3 vocab`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


@torch.no_grad()
def capture_samples(
    target: str | Path,
    num: int = 16,
    aux_layer_ids=(1, 2, 3),
    min_len=24,
    max_len=64,
    seed=0,
    token_ids: list | None = None,
    prompt_lens: list | None = None,
):
    """(samples, manifest) in eagle3.capture's format, by running the target in transformers on CPU.

    Token ids are random (seeded) so tiny random targets work; layer id k = hidden_states[k] (vLLM
    semantics); last_hidden_states is the output of the last decoder layer before the final norm
    (forward hook)."""
    from eagle3.hf import load_causal_lm

    model = load_causal_lm(target, dtype=torch.float32).eval()
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    grab: dict[str, torch.Tensor] = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: grab.__setitem__("last", o[0] if isinstance(o, tuple) else o)
    )
    samples = []
    # a little structure (repeated phrases) so a draft can learn something
    phrases = [torch.randint(0, V, (8,), generator=g) for _ in range(6)]
    for i in range(num if token_ids is None else len(token_ids)):
        if token_ids is None:
            n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
            parts = [
                phrases[int(torch.randint(0, len(phrases), (1,), generator=g))]
                for _ in range(n // 8 + 1)
            ]
            ids = torch.cat(parts)[:n]
        else:
            ids = torch.as_tensor(token_ids[i]).long()
            n = len(ids)
        out = model(ids[None], output_hidden_states=True)
        aux = torch.stack([out.hidden_states[k][0] for k in aux_layer_ids], dim=1)  # (T, n_aux, H)
        mask = torch.ones(n, dtype=torch.int8)
        mask[: (n // 4 if prompt_lens is None else prompt_lens[i])] = (
            0  # a "prompt" that is not supervised
        )
        samples.append(
            {
                "input_ids": ids.long(),
                "loss_mask": mask,
                "aux_hidden_states": aux.to(torch.bfloat16),
                "last_hidden_states": grab["last"][0].to(torch.bfloat16),
                "sample_id": f"s{i}",
            }
        )
    hook.remove()
    manifest = {
        "aux_layer_ids": list(aux_layer_ids),
        "hidden_size": model.config.hidden_size,
        "num_samples": len(samples),
        "target": str(target),
    }
    return samples, manifest


def write_vocab(out: str | Path, target_vocab: int, draft_ids: torch.Tensor) -> Path:
    """vocab.safetensors with d2t (target = i + d2t[i]) and t2d for the given sorted target ids."""
    from safetensors.torch import save_file

    draft_ids = draft_ids.long().sort().values
    d2t = draft_ids - torch.arange(draft_ids.numel())
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"d2t": d2t, "t2d": t2d}, str(out / "vocab.safetensors"))
    return out


def frequent_ids(samples: list[dict[str, Any]], k: int, target_vocab: int) -> torch.Tensor:
    counts = torch.zeros(target_vocab)
    for s in samples:
        counts += torch.bincount(torch.as_tensor(s["input_ids"]), minlength=target_vocab)[
            :target_vocab
        ].float()
    return counts.argsort(descending=True, stable=True)[:k]


def write_captured(
    out: str | Path, samples: list[dict[str, Any]], manifest: dict[str, Any], shard_samples: int = 8
) -> Path:
    """Write samples as a finished capture dir (eagle3.shards shards + manifest.json)."""
    from eagle3 import shards as storage
    from eagle3.artifacts import CaptureManifest

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for k, a in enumerate(range(0, len(samples), shard_samples)):
        buf = storage.ShardBuffer(first_index=a, next_index=a)
        for i, s in enumerate(samples[a : a + shard_samples]):
            buf.add(
                a + i,
                s["sample_id"],
                torch.as_tensor(s["input_ids"]),
                torch.as_tensor(s["loss_mask"]),
                s["aux_hidden_states"],
                s["last_hidden_states"],
            )
        shards.append(storage.write_shard(out, k, buf))
    record = {
        "format": CaptureManifest.FORMAT,
        **manifest,
        "num_samples": len(samples),
        "shards": shards,
    }
    CaptureManifest.from_dict(record, "write_captured").save(out)
    return out


@torch.no_grad()
def greedy_continuations(
    target: str | Path, num: int, prompt_len: int = 6, new_tokens: int = 40, seed: int = 0
):
    """Random prompts + the target's own greedy continuation (self-distillation data for tiny
    targets)."""
    from eagle3.hf import load_causal_lm

    model = load_causal_lm(target, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, model.config.vocab_size, (num, prompt_len), generator=g)
    out = model.generate(
        prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    return [row for row in out], [prompt_len] * num
