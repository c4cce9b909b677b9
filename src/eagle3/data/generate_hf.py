"""Batched generation with transformers, for hosts without vLLM (e.g. a bare GPU box).

The regenerate stage uses vLLM by default; `backend: hf` routes its generation here. Same contract
as the vLLM path: prompts are token ids already rendered with the target's chat template, outputs
are the generated token ids (eos included when generation stopped on it) and a finish reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3.hf import load_causal_lm


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str  # "stop" (hit eos) or "length"


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class HfGenerator:
    """A transformers causal LM loaded once, generating for batches of token-id prompts."""

    def __init__(
        self,
        target: str,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 256,
        trust_remote_code: bool = False,
    ):
        import torch
        from transformers import GenerationConfig

        self.device = resolve_device(device)
        if dtype == "auto":
            dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        self.batch_size = batch_size
        self.model = (
            load_causal_lm(target, dtype=getattr(torch, dtype), trust_remote_code=trust_remote_code)
            .to(self.device)
            .eval()
        )
        gen_cfg = GenerationConfig.from_model_config(self.model.config)
        eos = gen_cfg.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
        self.pad_id = (
            gen_cfg.pad_token_id
            if gen_cfg.pad_token_id is not None
            else next(iter(self.eos_ids), 0)
        )

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: set[int] | None = None,
    ) -> list[Generation]:
        """Generate for every prompt; greedy when temperature == 0. Outputs are in prompt order.
        `stop_ids`: more token ids that end a generation besides the model's eos (e.g. the end of a
        user turn)."""
        import torch

        stops = self.eos_ids | set(stop_ids or ())
        torch.manual_seed(seed)
        order = sorted(
            range(len(prompts)), key=lambda i: len(prompts[i])
        )  # similar lengths per batch
        results: list[Generation | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            width = max(len(prompts[i]) for i in idx)
            input_ids = torch.full(
                (len(idx), width), self.pad_id, dtype=torch.long
            )  # (B, T) left-padded
            attn = torch.zeros((len(idx), width), dtype=torch.long)  # (B, T)
            for row, i in enumerate(idx):
                p = prompts[i]
                input_ids[row, width - len(p) :] = torch.tensor(p)
                attn[row, width - len(p) :] = 1
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=input_ids.to(self.device),
                    attention_mask=attn.to(self.device),
                    max_new_tokens=max_new_tokens,
                    do_sample=temperature > 0,
                    temperature=temperature if temperature > 0 else None,
                    top_p=top_p if temperature > 0 else None,
                    top_k=None,
                    pad_token_id=self.pad_id,
                    eos_token_id=sorted(stops) or None,
                )  # (B, T + new)
            new = out[:, width:].tolist()
            for row, i in enumerate(idx):
                toks = new[row]
                cut = next((j for j, t in enumerate(toks) if t in stops), None)
                if cut is not None:
                    results[i] = Generation(token_ids=toks[: cut + 1], finish_reason="stop")
                else:
                    results[i] = Generation(token_ids=toks, finish_reason="length")
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Drop the model and give its GPU memory back (the next model can load)."""
        import torch

        self.model = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()
