"""One TTT training step on tensors: the part a GPU benchmark calls (no vLLM, no files, no host syncs).

    batch = PackedBatch(...)                      # tensors on the device
    out = ttt_forward(model, batch, head, steps=7)   # loss + per-step stat tensors
    # benchmarks/step_setup.py builds a synthetic batch for this step and times it (benchmarks/train_step.py)

Step j (0-based) at row t reads token ids[t+1+j] and is trained against the target's distribution at row t+1+j
(which predicts token t+2+j); the row is supervised iff rows t..t+2+j lie in one document and
loss_mask[t+2+j] (1 = assistant token). Rope positions of step j are pos[t]+j, as in vLLM's drafting loop.

Two optional terms: `temperature` divides both the draft's and the target's logits before the soft CE (< 1
sharpens the target towards its argmax, which is all greedy acceptance scores); `feature_weight` adds, per step,
the mean squared error between the RMS-normalised pre-norm hidden the draft outputs (what its next step reads)
and the RMS-normalised last hidden state of the target at row t+1+j (what the target predicts token t+2+j from),
EAGLE-1's feature regression: 384-wide supervision per row instead of one distribution. `mid_feature_weight`
does the same for the midlayer's output against aux block `mid_target_block` at row t+1+j: for a draft whose
later layers are the target's layers after that aux state (init_layers_from_target), the state they expect.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from eagle3.model.draft import Eagle3Draft
from eagle3.train.attention import make_ttt_attention
from eagle3.train.loss import TargetHead, compute_targets, fused_soft_ce, soft_ce

#: columns of StepOutput.stats, one row per TTT step
STAT_COLUMNS = ("n_valid", "n_correct", "n_cond", "n_cond_correct", "ce_sum", "n_loss", "feat_sum")


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (B, T) long
    positions: torch.Tensor  # (B, T) long, restart at 0 per document
    doc_ids: torch.Tensor  # (B, T) long, -1 = padding
    loss_mask: torch.Tensor  # (B, T) bool, 1 = supervised (assistant) token
    aux: torch.Tensor  # (B, T, n_aux*Ht)
    last_hidden: torch.Tensor  # (B, T, Ht) target's last decoder layer output, before its final norm
    target_argmax: torch.Tensor | None = None  # (B, T) long: the target's full-vocab argmax per row (-1 = padding),
    #   computed once per sample before training (eagle3.train.trainer.with_target_argmax); None: the step computes it

    def to(self, device, float_dtype=None) -> PackedBatch:
        def mv(x):
            if x is None:
                return None
            x = x.to(device, non_blocking=True)
            return x.to(float_dtype) if float_dtype is not None and x.is_floating_point() else x

        return PackedBatch(*(mv(getattr(self, f)) for f in self.__dataclass_fields__))


@dataclass
class StepOutput:
    loss: torch.Tensor  # () weighted sum over steps of the per-step mean CE
    stats: torch.Tensor  # (K, len(STAT_COLUMNS)) float sums, see STAT_COLUMNS
    correct: torch.Tensor | None = None  # (K, B, T) bool, only with return_correct: step j's token is the target's
    valid: torch.Tensor | None = None  # (K, B, T) bool, only with return_correct: step j's row is supervised


def linear_weight_casts(model: torch.nn.Module, device_type: str) -> dict[str, torch.Tensor]:
    """Under autocast: every trainable fp32 matrix (the Linear weights) cast ONCE to the autocast dtype, by name.

    Each weight is used by all K TTT steps. Cast inside every compiled block, each use re-reads the fp32 master
    (K casts) and sends an fp32 gradient back that AccumulateGrad adds into .grad (K fp32 read-modify-writes of
    every weight; ~12 ms per K=7/8192 step on an H200, docs/NOTES.md). Cast once here, the K uses share one bf16
    tensor: autograd sums their gradients in bf16 and one cast brings the sum to the fp32 .grad — the same
    arithmetic as eager autocast, whose weight-cast cache does exactly this (so the naive reference agrees).
    Empty (no-op) without autocast, for fp32 autocast, and for FSDP2's sharded (DTensor) parameters, whose mixed
    precision policy owns the casts."""
    if not torch.is_autocast_enabled(device_type):
        return {}
    dt = torch.get_autocast_dtype(device_type)
    params = list(model.named_parameters())
    if dt == torch.float32 or any(type(p) not in (torch.nn.Parameter, torch.Tensor) for _, p in params):
        return {}
    return {n: p.to(dt) for n, p in params if p.requires_grad and p.ndim == 2 and p.dtype == torch.float32}


def ttt_forward(model: Eagle3Draft, batch: PackedBatch, head: TargetHead, **options: Any) -> StepOutput:
    """The unrolled TTT forward (body and keyword options: `_ttt_forward`), with the draft's matrices cast once to
    the autocast dtype for the whole unroll (`linear_weight_casts`)."""
    from torch.nn.utils.stateless import _reparametrize_module

    casts = linear_weight_casts(model, batch.input_ids.device.type)
    ctx = _reparametrize_module(model, casts, strict=False) if casts else contextlib.nullcontext()
    with ctx:
        return _ttt_forward(model, batch, head, **options)


def _ttt_forward(
    model: Eagle3Draft,
    batch: PackedBatch,
    head: TargetHead,
    *,
    steps: int = 7,
    loss_decay: float = 0.8,
    attention: str = "auto",
    loss_chunk_rows: int = 8192,
    return_correct: bool = False,
    fused_loss: bool = True,
    temperature: float = 1.0,
    feature_weight: float = 0.0,
    mid_feature_weight: float = 0.0,
    mid_target_block: int = -1,
) -> StepOutput:
    ids, doc, pos = batch.input_ids, batch.doc_ids, batch.positions
    B, T = ids.shape
    pad = steps + 2
    tg = compute_targets(head, batch.last_hidden, pad, argmax=batch.target_argmax)  # logits (B, T+pad, Vd)
    doc_p = F.pad(doc, (0, pad), value=-2)  # (B, T+pad)
    mask_p = F.pad(batch.loss_mask.bool(), (0, pad), value=False)  # (B, T+pad)
    ids_p = F.pad(ids, (0, pad), value=0)  # (B, T+pad)
    feat_p = _rms_normalize(F.pad(batch.last_hidden, (0, 0, 0, pad))) if feature_weight > 0 else None  # (B, T+pad, Ht)
    mid_p = None
    if mid_feature_weight > 0:
        block = batch.aux.unflatten(-1, (model.cfg.num_aux, -1))[:, :, mid_target_block]  # (B, T, Ht)
        mid_p = _rms_normalize(F.pad(block, (0, 0, 0, pad)))  # (B, T+pad, Ht)
    attn = make_ttt_attention(attention, doc, steps)
    hidden = model.combine(batch.aux)  # (B, T, H)
    cache = model.new_cache()  # per layer: keys/values of every TTT step so far
    loss = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    rows, joint = [], (doc >= 0)  # (B, T) all previous steps correct
    corrects, valids = [], []
    for j in range(steps):
        r = 1 + j
        states = [] if mid_p is not None else None
        out, hidden = model.step(ids_p[:, r : r + T], hidden, pos + j, cache, attn, states)  # (B, T, H) x2
        same = (doc_p[:, r : r + T] == doc) & (doc_p[:, r + 1 : r + 1 + T] == doc) & (doc >= 0)  # (B, T)
        valid = same & mask_p[:, r + 1 : r + 1 + T]  # (B, T)
        weight = (valid & tg.in_vocab[:, r : r + T]).float()  # (B, T)
        ce = fused_soft_ce if fused_loss else soft_ce  # same values and gradients; fused: no recompute
        if temperature == 1.0:
            ce_sum, am = ce(out, model.lm_head.weight, tg.logits[:, r : r + T], weight, loss_chunk_rows)
        else:  # logits / temperature on both sides: scale the draft's input (linear head) and the target's logits
            ce_sum, am = ce(out / temperature, model.lm_head.weight, tg.logits[:, r : r + T] / temperature, weight,
                            loss_chunk_rows)
        n_loss = weight.sum()
        loss = loss + (loss_decay**j) * ce_sum / n_loss.clamp(min=1.0)
        feat_sum = loss.new_zeros(())
        if feat_p is not None:
            err = (_rms_normalize(hidden) - feat_p[:, r : r + T]).pow(2).mean(-1)  # (B, T)
            feat_sum = (err * valid).sum()
            loss = loss + feature_weight * (loss_decay**j) * feat_sum / valid.sum().clamp(min=1)
        if mid_p is not None:
            err = (_rms_normalize(states[0]) - mid_p[:, r : r + T]).pow(2).mean(-1)  # (B, T)
            loss = loss + mid_feature_weight * (loss_decay**j) * (err * valid).sum() / valid.sum().clamp(min=1)
        correct = ((am + model.d2t[am]) == tg.argmax[:, r : r + T]) & valid  # (B, T)
        cond = joint & valid  # (B, T)
        rows.append(torch.stack([valid.sum(), correct.sum(), cond.sum(), (cond & correct).sum()]).float())
        rows[-1] = torch.cat([rows[-1], ce_sum.detach()[None], n_loss[None], feat_sum.detach().float()[None]])
        joint = joint & correct
        if return_correct:
            corrects.append(correct)
            valids.append(valid)
    if return_correct:
        return StepOutput(loss, torch.stack(rows), torch.stack(corrects), torch.stack(valids))
    return StepOutput(loss, torch.stack(rows))


def _rms_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()  # (..., H)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., H)


def summarize(stats: torch.Tensor) -> dict[str, float]:
    """Per-step metrics from summed stats (K, 7): loss_j, acc_j (top-1 agreement), cond_acc_j, feat_j (feature
    error, only when the feature loss ran), and sim_accept_len = sum_j prod_{i<=j} cond_acc_i (expected accepted
    draft tokens per round, bonus excluded), num_rows (supervised rows at step 0)."""
    s = stats.double().cpu()
    out: dict[str, float] = {}
    prod, accept = 1.0, 0.0
    has_feat = bool(len(s)) and bool((s[:, 6] != 0).any())
    for j, (nv, nc, ncond, ncc, ce, nl, fs) in enumerate(s.tolist()):
        out[f"loss_{j}"] = ce / max(nl, 1.0)
        if has_feat:
            out[f"feat_{j}"] = fs / max(nv, 1.0)
        out[f"acc_{j}"] = nc / max(nv, 1.0)
        cacc = ncc / max(ncond, 1.0)
        out[f"cond_acc_{j}"] = cacc
        prod *= cacc
        accept += prod
    out["sim_accept_len"] = accept
    out["num_rows"] = s[0, 0].item() if len(s) else 0.0  # supervised step-0 rows summed into these stats
    return out


class TTTModule(torch.nn.Module):
    """Wraps the draft so the whole unrolled TTT forward is one `forward()` (what DDP/FSDP hook into)."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, batch: PackedBatch, head: TargetHead, **kw) -> tuple[torch.Tensor, ...]:
        """(loss, stats), plus (correct, valid) with return_correct=True."""
        out = ttt_forward(self.draft, batch, head, **kw)
        return (out.loss, out.stats) if out.correct is None else (out.loss, out.stats, out.correct, out.valid)
