"""A TTT training step on synthetic inputs, for the step benchmark (train_step.py) and the tests
that time or compile one step: random draft + random frozen target head + one synthetic packed
batch.

Needs only torch and the pydantic-free eagle3 modules (the GPU box has no pydantic, Prefect or
vLLM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.model.draft import DraftConfig, Eagle3Draft
from eagle3.train.attention import make_ttt_attention, naive_ttt_attention
from eagle3.train.loss import TargetHead, compute_target_argmax
from eagle3.train.step import PackedBatch, StepOutput, ttt_forward


@dataclass
class BenchmarkSetup:
    model: Eagle3Draft
    optimizer: torch.optim.Optimizer
    head: TargetHead
    batch: PackedBatch
    steps: int
    attention: str
    dtype: torch.dtype


def synthetic_batch(
    cfg: DraftConfig, batch_size: int, seq_len: int, device, dtype, docs_per_row: int = 2
) -> PackedBatch:
    g = torch.Generator().manual_seed(0)
    B, T = batch_size, seq_len
    bounds = torch.linspace(0, T, docs_per_row + 1).long()
    doc = torch.zeros(B, T, dtype=torch.long)
    pos = torch.zeros(B, T, dtype=torch.long)
    for i in range(docs_per_row):
        a, b = bounds[i].item(), bounds[i + 1].item()
        doc[:, a:b] = i
        pos[:, a:b] = torch.arange(b - a)
    batch = PackedBatch(
        input_ids=torch.randint(0, cfg.vocab_size, (B, T), generator=g),
        positions=pos,
        doc_ids=doc,
        loss_mask=torch.rand(B, T, generator=g) < 0.7,
        aux=torch.randn(B, T, cfg.num_aux * cfg.target_hidden_size, generator=g),
        last_hidden=torch.randn(B, T, cfg.target_hidden_size, generator=g),
    )
    return batch.to(device, dtype)


def build_benchmark(
    cfg: DraftConfig,
    *,
    batch_size: int = 1,
    seq_len: int = 2048,
    steps: int = 7,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    attention: str = "auto",
    compile: bool = False,
    compile_mode: str = "layer",
    target_argmax: bool = True,
) -> BenchmarkSetup:
    """Random draft + random frozen target head + one synthetic packed batch, all on `device`.
    `target_argmax`: the batch carries the target's full-vocab argmax computed once, as the
    trainer's batches do (False: the step computes it from the full-vocab head, the pipeline before
    2026-12-01 and streaming mode). Real dims: DraftConfig(hidden_size=4096,
    intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    vocab_size=128256, draft_vocab_size=32000, target_hidden_size=4096, num_aux=3,
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0)."""
    torch.manual_seed(0)
    model = Eagle3Draft(cfg).to(device)
    if compile:
        model.compile_blocks(compile_mode)
    head = TargetHead(
        norm_weight=torch.ones(cfg.target_hidden_size),
        eps=cfg.rms_norm_eps,
        lm_head=torch.randn(cfg.vocab_size, cfg.target_hidden_size) * 0.02,
        draft_ids=torch.randperm(cfg.vocab_size)[: cfg.draft_vocab_size].sort().values,
    ).to(device, dtype)
    model.d2t.copy_(
        head.draft_ids - torch.arange(cfg.draft_vocab_size, device=head.draft_ids.device)
    )
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=1e-4,
        betas=(0.9, 0.95),
        fused=device != "cpu",
    )
    batch = synthetic_batch(cfg, batch_size, seq_len, device, dtype)
    if target_argmax:
        flat = batch.last_hidden.reshape(batch_size * seq_len, -1)  # (B*T, Ht)
        batch.target_argmax = compute_target_argmax(head, flat).reshape(
            batch_size, seq_len
        )  # (B, T)
    return BenchmarkSetup(model, opt, head, batch, steps, attention, dtype)


def run_benchmark_step(s: BenchmarkSetup, grad_clip: float = 0.5) -> StepOutput:
    """Forward + backward + clip + AdamW step under autocast; returns tensors (no host sync)."""
    dev = s.batch.input_ids.device.type
    with torch.autocast(dev, dtype=s.dtype, enabled=s.dtype != torch.float32):
        out = ttt_forward(s.model, s.batch, s.head, steps=s.steps, attention=s.attention)
    out.loss.backward()
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(s.model.parameters(), grad_clip, foreach=True)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    return out


def check_flex(device: str = "cuda") -> dict:
    """flex and sdpa TTT attention vs the naive kernel (fp32), values and gradients: max abs
    differences."""
    B, T, steps, nh, kvh, d = 2, 512, 4, 8, 2, 64
    g = torch.Generator(device="cpu").manual_seed(0)
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, 200:] = 1
    doc[1, 300:] = -1
    doc = doc.to(device)
    mk = lambda *s: torch.randn(*s, generator=g).to(device).requires_grad_()  # noqa: E731
    q = mk(B, nh, T, d)
    ks = [mk(B, kvh, T, d) for _ in range(steps)]
    vs = [mk(B, kvh, T, d) for _ in range(steps)]
    leaves = [q, *ks, *vs]
    ref = naive_ttt_attention(q, ks, vs, doc)
    out = {}
    for kind in ("flex", "sdpa"):
        got = make_ttt_attention(kind, doc, steps)(q, ks, vs)
        w = torch.randn_like(ref)
        ga = torch.autograd.grad((got * w).sum(), leaves)
        gb = torch.autograd.grad((ref * w).sum(), leaves, retain_graph=True)
        out[kind] = {
            "max_abs_out": (got - ref).abs().max().item(),
            "max_abs_grad": max((a - b).abs().max().item() for a, b in zip(ga, gb, strict=True)),
        }
    return out
