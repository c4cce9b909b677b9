"""One TTT training step on tensors: the part a GPU benchmark calls (no vLLM, no files, no host
syncs).

    batch = PackedBatch(...)                      # tensors on the device
    out = ttt_forward(model, batch, head, steps=7)   # loss + per-step stat tensors
    # benchmarks/step_setup.py builds a synthetic batch for this step and times it
    # (benchmarks/train_step.py)

Step j (0-based) at row t reads token ids[t+1+j] and is trained against the target's distribution at
row t+1+j (which predicts token t+2+j); the row is supervised iff rows t..t+2+j lie in one document
and loss_mask[t+2+j] (1 = assistant token). Rope positions of step j are pos[t]+j, as in vLLM's
drafting loop.

Row weights: `batch.step_weight` (B, T, K) multiplies step j's weight at row t (on-policy
refinement trains only the drafting rounds the draft ran, eagle3.refine);
`loss_weighting="accept_until_fail"` multiplies it by the draft's own probability (detached) of
having drafted the target's tokens at steps < j: the chance that step j is reached.
`accept_on="next_token"` scores a step correct when the draft's token is the sequence's next token
rather than the target's argmax: on a sampled rollout that is exactly vLLM's acceptance (it drafts
greedily with one-hot draft probabilities, so a rejected draft token is never the emitted one).

Two optional terms: `temperature` divides both the draft's and the target's logits before the soft
CE (< 1 sharpens the target towards its argmax, which is all greedy acceptance scores);
`feature_weight` adds, per step, the mean squared error between the RMS-normalised pre-norm hidden
the draft outputs (what its next step reads) and the RMS-normalised last hidden state of the target
at row t+1+j (what the target predicts token t+2+j from), EAGLE-1's feature regression: 384-wide
supervision per row instead of one distribution. `mid_feature_weight` does the same for the
midlayer's output against aux block `mid_target_block` at row t+1+j: for a draft whose later layers
are the target's layers after that aux state (init_layers_from_target), the state they expect.
`copy_weight` multiplies the soft CE of every row whose token continues a span repeated earlier in
its document (`copy_rows`: the 3-gram ending at the token occurred before), the rows on which prompt
lookup drafts and is right.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from eagle3.model.family import DraftModel
from eagle3.train.attention import make_ttt_attention
from eagle3.train.loss import SharedHeadGrad, TargetHead, compute_targets, fused_soft_ce, soft_ce

#: columns of StepOutput.stats, one row per TTT step
STAT_COLUMNS = ("n_valid", "n_correct", "n_cond", "n_cond_correct", "ce_sum", "n_loss", "feat_sum")


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (B, T) long
    positions: torch.Tensor  # (B, T) long, restart at 0 per document
    doc_ids: torch.Tensor  # (B, T) long, -1 = padding
    loss_mask: torch.Tensor  # (B, T) bool, 1 = supervised (assistant) token
    aux: torch.Tensor  # (B, T, n_aux*Ht)
    last_hidden: (
        torch.Tensor
    )  # (B, T, Ht) target's last decoder layer output, before its final norm
    target_argmax: torch.Tensor | None = (
        None  # (B, T) long: the target's full-vocab argmax per row (-1 = padding),
    )
    #   computed once per sample before training (eagle3.train.trainer.with_target_argmax); None:
    #   the step computes it
    step_weight: torch.Tensor | None = None  # (B, T, K) float: loss weight of TTT step j at row t
    #   (eagle3.refine's rollouts: the replayed rounds' steps); None: every supervised row weighs 1

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
    correct: torch.Tensor | None = (
        None  # (K, B, T) bool, only with return_correct: step j's token is the target's
    )
    valid: torch.Tensor | None = (
        None  # (K, B, T) bool, only with return_correct: step j's row is supervised
    )


def linear_weight_casts(model: torch.nn.Module, device_type: str) -> dict[str, torch.Tensor]:
    """Under autocast: every trainable fp32 matrix (the Linear weights) cast ONCE to the autocast
    dtype, by name.

    Each weight is used by all K TTT steps. Cast inside every compiled block, each use re-reads the
    fp32 master (K casts) and sends an fp32 gradient back that AccumulateGrad adds into .grad (K
    fp32 read-modify-writes of every weight; ~12 ms per K=7/8192 step on an H200, docs/history/).
    Cast once here, the K uses share one bf16 tensor: autograd sums their gradients in bf16 and one
    cast brings the sum to the fp32 .grad — the same arithmetic as eager autocast, whose weight-cast
    cache does exactly this (so the naive reference agrees). Empty (no-op) without autocast, for
    fp32 autocast, and for FSDP2's sharded (DTensor) parameters, whose mixed precision policy owns
    the casts."""
    if not torch.is_autocast_enabled(device_type):
        return {}
    dt = torch.get_autocast_dtype(device_type)
    params = list(model.named_parameters())
    if dt == torch.float32 or any(
        type(p) not in (torch.nn.Parameter, torch.Tensor) for _, p in params
    ):
        return {}
    return {
        n: p.to(dt)
        for n, p in params
        if p.requires_grad and p.ndim == 2 and p.dtype == torch.float32
    }


def ttt_forward(
    model: DraftModel, batch: PackedBatch, head: TargetHead, **options: Any
) -> StepOutput:
    """The unrolled TTT forward (body and keyword options: `_ttt_forward`), with the draft's
    matrices cast once to the autocast dtype for the whole unroll (`linear_weight_casts`)."""
    from torch.nn.utils.stateless import _reparametrize_module

    casts = linear_weight_casts(model, batch.input_ids.device.type)
    ctx = _reparametrize_module(model, casts, strict=False) if casts else contextlib.nullcontext()
    with ctx:
        return _ttt_forward(model, batch, head, **options)


def _ttt_forward(
    model: DraftModel,
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
    copy_weight: float = 1.0,
    loss_weighting: str = "uniform",
    accept_on: str = "target_argmax",
) -> StepOutput:
    """The K-step unroll: each step drafts every row from the previous step's hidden states and
    adds its weighted soft cross-entropy (and feature losses) to the loss.

    Kept whole: the steps share a dozen tensors (the padded targets and ids, the row weights, the
    KV cache, the reach of accept_until_fail, the feature targets), which a per-step function
    would all take as arguments; the row weights and the metrics are their own functions."""
    if loss_weighting not in ("uniform", "accept_until_fail"):
        raise ValueError(f"loss_weighting={loss_weighting!r}: use uniform or accept_until_fail")
    if accept_on not in ("target_argmax", "next_token"):
        raise ValueError(f"accept_on={accept_on!r}: use target_argmax or next_token")
    ids, doc, pos = batch.input_ids, batch.doc_ids, batch.positions
    T = ids.shape[1]  # ids: (B, T)
    pad = steps + 2
    tg = compute_targets(
        head, batch.last_hidden, pad, argmax=batch.target_argmax
    )  # logits (B, T+pad, Vd)
    doc_p = F.pad(doc, (0, pad), value=-2)  # (B, T+pad)
    mask_p = F.pad(batch.loss_mask.bool(), (0, pad), value=False)  # (B, T+pad)
    ids_p = F.pad(ids, (0, pad), value=0)  # (B, T+pad)
    # every step's row masks at once (a few kernels, not a few per step): step j at row t reads row
    # t+1+j
    valid, weight, n_loss = _step_masks(
        doc, doc_p, mask_p, tg.in_vocab, steps
    )  # (K, B, T) x2, (K,)
    weight, n_loss = _weigh_rows(batch, head, weight, n_loss, copy_weight, steps, pad)
    reach, tgt_draft = None, None
    if loss_weighting == "accept_until_fail":  # row weights: P(steps < j drafted right), detached
        reach = torch.ones_like(weight[0])  # (B, T)
        target_ids = _windows(tg.argmax, 1, steps, T)  # (K, B, T): step j's target at row t+1+j
        tgt_draft = _draft_ids_of(head, model, target_ids)  # (K, B, T) draft id or -1
    feat_p = (
        _rms_normalize(F.pad(batch.last_hidden, (0, 0, 0, pad))) if feature_weight > 0 else None
    )  # (B, T+pad, Ht)
    mid_p = None
    if mid_feature_weight > 0:
        block = batch.aux.unflatten(-1, (model.cfg.num_aux, -1))[
            :, :, mid_target_block
        ]  # (B, T, Ht)
        mid_p = _rms_normalize(F.pad(block, (0, 0, 0, pad)))  # (B, T+pad, Ht)
    attn = make_ttt_attention(attention, doc, steps)
    hidden = model.combine(batch.aux)  # (B, T, H)
    cache = model.new_cache()  # per layer: keys/values of every TTT step so far
    loss = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    argmaxes, ce_sums, feat_sums = [], [], []
    decay = loss_decay ** torch.arange(steps, device=loss.device, dtype=loss.dtype)  # (K,)
    coef = decay / n_loss.to(loss.dtype).clamp(
        min=1.0
    )  # (K,) step j's CE factor: decay^j / its loss rows
    shared = (
        SharedHeadGrad()
    )  # the head's gradient summed over the K steps inside the fused loss's GEMMs
    for j in range(steps):
        r = 1 + j
        states = [] if mid_p is not None else None
        out, hidden = model.step(
            ids_p[:, r : r + T], hidden, pos + j, cache, attn, states
        )  # (B, T, H) x2
        h, tgt = out, tg.logits[:, r : r + T]  # (B, T, H), (B, T, Vd)
        if (
            temperature != 1.0
            # logits / temperature on both sides: scale the draft's input (linear head) and the
            # target's
        ):
            h, tgt = h / temperature, tgt / temperature
        w_j = weight[j] if reach is None else weight[j] * reach  # (B, T)
        if not fused_loss:  # the autograd reference: same values and gradients
            ce_sum, am = soft_ce(h, model.lm_head.weight, tgt, w_j, loss_chunk_rows)
        else:
            lse = (
                tg.lse[:, r : r + T] if temperature == 1.0 else None
            )  # the target rows' softmax normaliser
            ce_sum, am = fused_soft_ce(
                h,
                model.lm_head.weight,
                tgt,
                w_j,
                loss_chunk_rows,
                tgt_lse=lse,
                grad_scale=coef[j],
                shared=shared,
            )
        if reach is not None and j + 1 < steps:
            q = draft_token_prob(out, model.lm_head.weight, tgt_draft[j], loss_chunk_rows)
            reach = reach * q  # (B, T)
        loss = loss + ce_sum * coef[j]
        feat_sum = loss.new_zeros(())
        if feat_p is not None:
            err = (_rms_normalize(hidden) - feat_p[:, r : r + T]).pow(2).mean(-1)  # (B, T)
            feat_sum = (err * valid[j]).sum()
            loss = loss + feature_weight * (loss_decay**j) * feat_sum / valid[j].sum().clamp(min=1)
        if mid_p is not None:
            err = (_rms_normalize(states[0]) - mid_p[:, r : r + T]).pow(2).mean(-1)  # (B, T)
            loss = loss + mid_feature_weight * (loss_decay**j) * (err * valid[j]).sum() / valid[
                j
            ].sum().clamp(min=1)
        argmaxes.append(am)
        ce_sums.append(ce_sum.detach())
        feat_sums.append(feat_sum.detach())
    # the metrics, for all steps at once
    am = torch.stack(argmaxes)  # (K, B, T) draft ids
    # step j at row t drafts token t+2+j: the target's argmax at row t+1+j, or the sequence's own
    if accept_on == "target_argmax":
        truth = _windows(tg.argmax, 1, steps, T)  # (K, B, T)
    else:
        truth = _windows(ids_p, 2, steps, T)  # (K, B, T)
    correct = ((am + model.d2t[am]) == truth) & valid  # (K, B, T)
    dt = torch.promote_types(loss.dtype, torch.float32)
    stats = _step_stats(doc, valid, correct, ce_sums, n_loss, feat_sums, dt)
    if return_correct:
        return StepOutput(loss, stats, correct, valid)
    return StepOutput(loss, stats)


def _weigh_rows(
    batch: PackedBatch,
    head: TargetHead,
    weight: torch.Tensor,
    n_loss: torch.Tensor,
    copy_weight: float,
    steps: int,
    pad: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (K, B, T) loss weights with the copied tokens' weight and the batch's own step
    weights applied, and each step's weighted row count (K,)."""
    ids, doc = batch.input_ids, batch.doc_ids
    T = ids.shape[1]
    if copy_weight != 1.0:
        # step j at row t predicts token t+2+j: weight it by whether that token is a copy
        rows = 1.0 + (copy_weight - 1.0) * copy_rows(ids, doc, head.lm_head.shape[0]).to(
            weight.dtype
        )  # (B, T)
        weight = weight * _windows(F.pad(rows, (0, pad), value=1.0), 2, steps, T)  # (K, B, T)
        n_loss = weight.sum((1, 2))  # (K,): each step's CE is the weighted mean over its rows
    if batch.step_weight is not None:  # (B, T, K>=steps): only the weighted rows and steps train
        sw = batch.step_weight
        if sw.shape[-1] < steps:
            raise ValueError(f"batch.step_weight has {sw.shape[-1]} steps, the unroll {steps}")
        weight = weight * sw[..., :steps].permute(2, 0, 1).to(weight.dtype)  # (K, B, T)
        n_loss = weight.sum((1, 2))  # (K,)
    return weight, n_loss


def _step_stats(
    doc: torch.Tensor,
    valid: torch.Tensor,
    correct: torch.Tensor,
    ce_sums: list[torch.Tensor],
    n_loss: torch.Tensor,
    feat_sums: list[torch.Tensor],
    dt: torch.dtype,
) -> torch.Tensor:
    """(K, len(STAT_COLUMNS)) per step: valid rows, correct ones, rows the step is reached at
    (every earlier step correct), correct ones of those, the CE sum, the loss rows, the feature
    error sum."""
    # cond: rows whose earlier steps were all correct (step 0: every real row), i.e. the step is
    # reached in vLLM
    joint = (
        torch.cat([(doc >= 0)[None], correct[:-1]]).to(torch.uint8).cumprod(0).bool()
    )  # (K, B, T)
    cond = joint & valid  # (K, B, T)
    counts = [x.sum((1, 2)).to(dt) for x in (valid, correct, cond, cond & correct)]  # 4 x (K,)
    return torch.stack(
        [*counts, torch.stack(ce_sums).to(dt), n_loss.to(dt), torch.stack(feat_sums).to(dt)], 1
    )


def _draft_ids_of(head: TargetHead, model: DraftModel, target_ids: torch.Tensor) -> torch.Tensor:
    """Target token ids (any shape; -1 = none) -> the draft vocabulary's ids of those tokens, -1
    where the draft vocabulary lacks them."""
    V, dev = model.t2d.numel(), target_ids.device
    inv = torch.full((V + 1,), -1, dtype=torch.long, device=dev)  # (V+1,): [V] stands for none
    inv[head.draft_ids.to(dev)] = torch.arange(head.draft_ids.numel(), device=dev)
    return inv[torch.where(target_ids >= 0, target_ids, V)]


@torch.no_grad()
def draft_token_prob(
    h: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, chunk_rows: int = 8192
) -> torch.Tensor:
    """(B, T) fp32: softmax(h @ w.T)[ids] per row, 0 where ids < 0 (a token outside the draft
    vocabulary). h: (B, T, H) the draft's normed output; w: (Vd, H) its head; ids: (B, T) draft
    ids. Row-chunked: the (rows, Vd) logits only ever exist for `chunk_rows` rows."""
    B, T, H = h.shape
    hf, idf = h.reshape(B * T, H), ids.reshape(B * T)  # (N, H), (N,)
    out = torch.zeros(B * T, dtype=torch.float32, device=h.device)  # (N,)
    for a in range(0, B * T, chunk_rows):
        logits = (hf[a : a + chunk_rows] @ w.T.to(hf.dtype)).float()  # (c, Vd)
        i = idf[a : a + chunk_rows]  # (c,)
        picked = logits.gather(1, i.clamp(min=0)[:, None])[:, 0]  # (c,)
        out[a : a + chunk_rows] = torch.where(i >= 0, (picked - logits.logsumexp(-1)).exp(), 0.0)
    return out.view(B, T)


def _windows(x: torch.Tensor, start: int, n: int, T: int) -> torch.Tensor:
    """(B, T+pad) -> (n, B, T) contiguous: windows start..start+n-1 of width T (window r = columns
    r..r+T-1)."""
    return x.unfold(1, T, 1)[:, start : start + n].transpose(0, 1).contiguous()  # (n, B, T)


def _step_masks(doc, doc_p, mask_p, in_vocab, steps: int):
    """Per TTT step j: valid (K, B, T) bool: row t is supervised at step j (rows t..t+2+j in one
    document, and loss_mask[t+2+j]); weight (K, B, T) float: valid and the target's argmax at row
    t+1+j is in the draft vocab (the loss's rows); n_loss (K,): weight summed."""
    T = doc.shape[1]
    d = _windows(doc_p, 1, steps + 1, T) == doc  # (K+1, B, T): row t+1+i in row t's document
    valid = d[:-1] & d[1:] & (doc >= 0) & _windows(mask_p, 2, steps, T)  # (K, B, T)
    weight = (valid & _windows(in_vocab, 1, steps, T)).float()  # (K, B, T)
    return valid, weight, weight.sum((1, 2))


def copy_rows(ids: torch.Tensor, doc: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, T) bool: token p continues a span repeated earlier in its document, i.e. the 3-gram
    ids[p-2..p] (all three in one document) also ends at an earlier position of that document: where
    prompt lookup's proposal (the tokens after an earlier occurrence of the context's suffix) holds
    the right token. Exact (each 3-gram is one int64 key, so vocab_size < 2**21), on the device,
    without a host sync: two stable sorts group equal (document, key) pairs in position order, and
    every pair but the first of its group is a copy."""
    if vocab_size >= 2**21:
        raise ValueError(
            f"copy_rows: vocab_size {vocab_size} >= 2**21 does not fit a 3-gram in one int64 key"
        )
    B, T = ids.shape
    rep = torch.zeros(B, T, dtype=torch.bool, device=ids.device)  # (B, T)
    if T < 3:
        return rep
    same = (doc[:, :-2] == doc[:, 2:]) & (
        doc[:, 2:] >= 0
    )  # (B, T-2): the 3-gram ending at p = 2.. is one document's
    key = (ids[:, :-2] * vocab_size + ids[:, 1:-1]) * vocab_size + ids[:, 2:]  # (B, T-2) >= 0
    unique = -1 - torch.arange(B * (T - 2), device=ids.device).view(
        B, T - 2
    )  # (B, T-2) < 0: matches nothing
    key = torch.where(same, key, unique).flatten()  # (N,)
    # a document (packed documents are contiguous) is named by its row and first column, whatever
    # its doc id
    cols = torch.arange(T, device=ids.device).expand(B, T)  # (B, T)
    starts = (
        torch.where(F.pad(doc[:, 1:] != doc[:, :-1], (1, 0), value=True), cols, 0).cummax(1).values
    )  # (B, T)
    group = (torch.arange(B, device=ids.device)[:, None] * T + starts[:, 2:]).flatten()  # (N,)
    by_key = torch.sort(key, stable=True).indices  # (N,) position order kept within a key
    order = by_key[
        torch.sort(group[by_key], stable=True).indices
    ]  # (N,) by (document, key, position)
    k, g = key[order], group[order]  # (N,)
    later = torch.zeros_like(k, dtype=torch.bool)  # (N,)
    later[1:] = (k[1:] == k[:-1]) & (g[1:] == g[:-1])
    rep[:, 2:] = torch.zeros_like(later).scatter(0, order, later).view(B, T - 2)
    return rep


def _rms_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()  # (..., H)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # (..., H)


def summarize(stats: torch.Tensor) -> dict[str, float]:
    """Per-step metrics from summed stats (K, 7): loss_j, acc_j (top-1 agreement), cond_acc_j,
    feat_j (feature error, only when the feature loss ran), and sim_accept_len = sum_j prod_{i<=j}
    cond_acc_i (expected accepted draft tokens per round, bonus excluded), num_rows (supervised rows
    at step 0)."""
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
    out["num_rows"] = (
        s[0, 0].item() if len(s) else 0.0
    )  # supervised step-0 rows summed into these stats
    return out


class TTTModule(torch.nn.Module):
    """Wraps the draft so the whole unrolled TTT forward is one `forward()` (what DDP/FSDP hook
    into)."""

    def __init__(self, draft: DraftModel):
        super().__init__()
        self.draft = draft

    def forward(self, batch: PackedBatch, head: TargetHead, **kw) -> tuple[torch.Tensor, ...]:
        """(loss, stats), plus (correct, valid) with return_correct=True."""
        out = ttt_forward(self.draft, batch, head, **kw)
        return (
            (out.loss, out.stats)
            if out.correct is None
            else (out.loss, out.stats, out.correct, out.valid)
        )
