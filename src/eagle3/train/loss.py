"""Targets and the chunked soft cross-entropy.

The target distribution at row r is softmax over the *draft vocabulary* of the target's logits
`lm_head(final_norm(last_hidden[r]))[draft_ids]` (frozen). The loss is forward KL(target || draft)
up to the target's (constant) entropy, i.e. soft cross-entropy, over supervised rows only.

Out-of-vocabulary choice: a row whose full-vocab target argmax is NOT in the draft vocab is dropped
from the loss (the draft can never propose that token, so the renormalised in-vocab distribution
would teach it to be confidently wrong), but it stays in the metrics as a miss (acceptance there is
0 in vLLM too). This matches SpecForge's `position_mask = t2d[target_argmax] & loss_mask`.

The full-vocab argmax is a property of the sample, not of the step: the trainer computes it once per
sample before training (`compute_target_argmax`, carried as `PackedBatch.target_argmax`), so an
epoch's steps compute only the draft-vocab columns (Vd of V rows of the head: 4096 of 49,152 for
SmolLM2, 32,000 of 128,256 for Llama-3.1). A batch without it (streaming mode, tests) gets both from
one full-vocab GEMM here.

Memory: target logits are computed once per batch, row-chunked (the full-vocab (rows, V) matrix only
ever exists for `chunk_rows`), and kept over the draft vocab only. Two losses with equal values and
gradients: `soft_ce` (autograd; the draft's (rows, Vd) fp32 log-softmax per row chunk inside
activation checkpointing, the naive reference) and `fused_soft_ce` (the default: gradient formed in
the forward, chunk by chunk, by one compiled kernel per chunk on CUDA; nothing of size (rows, Vd) is
kept for backward).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class TargetHead:
    """The frozen target pieces the loss needs."""

    norm_weight: torch.Tensor  # (Ht,)
    eps: float
    lm_head: torch.Tensor  # (V, Ht) full target head (for the full-vocab argmax)
    draft_ids: torch.Tensor  # (Vd,) long: target id of each draft id (= arange + d2t)
    draft_lm_head: torch.Tensor | None = (
        None  # (Vd, Ht) the head's draft-vocab rows; filled on construction
    )

    def __post_init__(self):
        if self.draft_lm_head is None:
            self.draft_lm_head = self.lm_head.index_select(
                0, self.draft_ids.to(self.lm_head.device)
            )  # (Vd, Ht)

    def to(self, device, dtype=None) -> TargetHead:
        dt = dtype or self.lm_head.dtype
        return TargetHead(
            self.norm_weight.to(device, dt),
            self.eps,
            self.lm_head.to(device, dt),
            self.draft_ids.to(device),
        )

    def normed(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """The target's final RMSNorm of (..., Ht) pre-norm states, in the head's dtype (fp32
        statistics)."""
        x = last_hidden.to(self.lm_head.dtype)  # (..., Ht)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # (..., Ht)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.norm_weight


@dataclass
class Targets:
    logits: torch.Tensor  # (B, T+pad, Vd) target logits over the draft vocab; zero rows past T
    argmax: torch.Tensor  # (B, T+pad) long: full-vocab target argmax (target ids); -1 past T
    in_vocab: torch.Tensor  # (B, T+pad) bool: argmax is in the draft vocab
    lse: torch.Tensor | None = (
        None  # (B, T+pad) fp32 log-sum-exp of each row of `logits` (as stored): every TTT
    )
    #   step reads the same rows shifted, so their softmax normaliser is computed once per batch,
    #   not K times


@torch.no_grad()
def compute_target_argmax(
    head: TargetHead, last_hidden: torch.Tensor, chunk_rows: int = 4096
) -> torch.Tensor:
    """(N,) long: the target's full-vocab argmax of each row of last_hidden (N, Ht), chunked over
    rows (the (rows, V) logits only ever exist for `chunk_rows`). The same arithmetic as
    compute_targets' fallback."""
    out = torch.empty(last_hidden.shape[0], dtype=torch.long, device=last_hidden.device)  # (N,)
    for a in range(0, last_hidden.shape[0], chunk_rows):
        out[a : a + chunk_rows] = (
            head.normed(last_hidden[a : a + chunk_rows]) @ head.lm_head.T
        ).argmax(-1)  # (c,)
    return out


@torch.no_grad()
def compute_targets(
    head: TargetHead,
    last_hidden: torch.Tensor,
    pad: int,
    chunk_rows: int = 2048,
    argmax: torch.Tensor | None = None,
) -> Targets:
    """last_hidden: (B, T, Ht) output of the target's last decoder layer, before its final norm;
    argmax: (B, T) the full-vocab argmax of those rows if already known (compute_target_argmax; -1
    on padding), else computed here from the full-vocab GEMM that also gives the draft-vocab
    columns."""
    B, T, _ = last_hidden.shape
    Vd = head.draft_ids.numel()
    dev = last_hidden.device
    logits = torch.zeros(B, T + pad, Vd, dtype=head.lm_head.dtype, device=dev)  # (B, T+pad, Vd)
    acc = torch.promote_types(head.lm_head.dtype, torch.float32)
    lse = torch.full(
        (B, T + pad), math.log(Vd), dtype=acc, device=dev
    )  # (B, T+pad): zero rows past T
    full_argmax = torch.full((B, T + pad), -1, dtype=torch.long, device=dev)  # (B, T+pad)
    t2d = torch.zeros(head.lm_head.shape[0], dtype=torch.bool, device=dev)  # (V,)
    t2d.index_fill_(
        0, head.draft_ids, True
    )  # not `t2d[ids] = True`: that copies the scalar host->device (a sync)
    if argmax is not None:
        full_argmax[:, :T] = argmax
    for a in range(0, T, max(1, chunk_rows // B)):
        x = head.normed(last_hidden[:, a : a + chunk_rows // B])  # (B, c, Ht)
        c = x.shape[1]
        if argmax is not None:  # only the Vd draft-vocab rows of the head
            logits[:, a : a + c] = x @ head.draft_lm_head.T  # (B, c, Vd)
        else:  # one GEMM gives the argmax and the draft-vocab columns
            full = x @ head.lm_head.T  # (B, c, V)
            full_argmax[:, a : a + c] = full.argmax(-1)  # (B, c)
            logits[:, a : a + c] = full.index_select(-1, head.draft_ids)  # (B, c, Vd)
        lse[:, a : a + c] = (_compiled_row_lse() if dev.type == "cuda" else _row_lse)(
            logits[:, a : a + c]
        )  # (B, c)
    in_vocab = t2d[full_argmax.clamp(min=0)] & (full_argmax >= 0)  # (B, T+pad)
    return Targets(logits, full_argmax, in_vocab, lse)


def _chunk_ce(h, w, tgt, weight):
    acc = torch.promote_types(
        h.dtype, torch.float32
    )  # fp32 softmax for bf16 inputs (fp64 stays fp64)
    logq = F.log_softmax((h @ w.T).to(acc), dim=-1)  # (B, c, Vd)
    p = F.softmax(tgt.to(acc), dim=-1)  # (B, c, Vd)
    ce = -(p * logq).sum(-1)  # (B, c)
    return (ce * weight).sum(), logq.argmax(-1)  # (), (B, c)


def soft_ce(
    h: torch.Tensor,
    w: torch.Tensor,
    tgt: torch.Tensor,
    weight: torch.Tensor,
    chunk_rows: int = 4096,
):
    """Sum over rows of weight * CE(softmax(tgt), log_softmax(h @ w.T)), chunked; also the draft
    argmax.

    h: (B, T, H) normed draft output; w: (Vd, H) draft lm_head; tgt: (B, T, Vd); weight: (B, T)
    float.
    """
    B, T, _ = h.shape
    step = max(1, chunk_rows // B)
    total, arg = h.new_zeros((), dtype=torch.promote_types(h.dtype, torch.float32)), []
    for a in range(0, T, step):
        args = (h[:, a : a + step], w, tgt[:, a : a + step], weight[:, a : a + step])
        if torch.is_grad_enabled() and h.requires_grad:
            s, am = checkpoint(_chunk_ce, *args, use_reentrant=False)
        else:
            s, am = _chunk_ce(*args)
        total = total + s
        arg.append(am)
    return total, torch.cat(arg, dim=1)  # (), (B, T)


def _row_lse(x: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...): log-sum-exp of each row in >= fp32 (compiled on CUDA: one read of x; eager
    it would materialise an fp32 copy and pass over it five times, ~3.5 ms per K=7/8192 batch on an
    H200)."""
    return x.to(torch.promote_types(x.dtype, torch.float32)).logsumexp(-1)


@functools.cache
def _compiled_row_lse():
    return torch.compile(_row_lse, dynamic=False)


def _ce_chunk(
    logits: torch.Tensor,
    tgt: torch.Tensor,
    tgt_lse: torch.Tensor | None,
    wt: torch.Tensor,
    grad_scale: torch.Tensor,
    need_grad: bool,
):
    """One row chunk of the fused loss: (sum_rows wt * CE, draft argmax (c,), gradient wrt logits or
    None).

    logits: (c, Vd) draft logits (matmul output dtype); tgt: (c, Vd) target logits; tgt_lse: (c,)
    their log-sum-exp (Targets.lse; None: computed here); wt: (c,) row weights; grad_scale: () the
    factor the caller multiplies the sum by (folded into the gradient here). The softmax statistics
    are fp32 (fp64 stays fp64); the gradient grad_scale * wt * (softmax(logits) - softmax(tgt)) is
    returned in the logits' dtype, ready for the two backward GEMMs. With the target's normaliser
    given, nothing reduces over tgt: on CUDA this function compiles to one pass over the logits (the
    online softmax statistics and the argmax) and one over (logits, tgt) that sums the CE and writes
    the gradient.
    """
    acc = torch.promote_types(logits.dtype, torch.float32)
    lf = logits.to(acc)  # (c, Vd)
    logq = torch.log_softmax(
        lf, dim=-1
    )  # (c, Vd): its row statistics in one (online) pass over the logits
    lse_t = _row_lse(tgt) if tgt_lse is None else tgt_lse.to(acc)  # (c,)
    p = (tgt.to(acc) - lse_t[:, None]).exp()  # (c, Vd) softmax(tgt), no reduction over tgt here
    w = wt.to(acc)  # (c,)
    ce = ((p * logq).sum(-1) * w).sum().neg()  # ()
    if not need_grad:
        return ce, lf.argmax(-1), None
    g = ((logq.exp() - p) * (w * grad_scale.to(acc))[:, None]).to(logits.dtype)  # (c, Vd)
    return ce, lf.argmax(-1), g


@functools.cache
def _compiled_ce_chunk():
    return torch.compile(_ce_chunk, dynamic=False)


class SharedHeadGrad:
    """The head weight's gradient summed over the K calls of one TTT unroll (every step multiplies
    the same head).

    Without it, each call keeps its own (Vd, H) gradient and autograd adds the K of them (K-1 reads
    and writes of (Vd, H), plus K scalings; ~2 ms per K=7 step at Llama-8B draft dims on an H200).
    With it, each call's GEMM adds its part into one running sum (beta=1: the GEMM's own
    accumulation, the same rounding as autograd's add), and the first call of the unroll returns the
    sum in backward, once per backward pass (the others return None). Exact only when the callers'
    loss is sum_j grad_scale_j * total_j (what grad_scale says), as in ttt_forward."""

    def __init__(self):
        self.grad: torch.Tensor | None = None  # (Vd, H)
        self.num_calls = 0


class _FusedSoftCE(torch.autograd.Function):
    """sum_rows weight * CE(softmax(tgt), log_softmax(h @ w.T)) with its gradient computed in the
    forward, chunk by chunk: d/dlogits = weight * (softmax(logits) - softmax(tgt)), so grad_h = g @
    w and grad_w = g.T @ h are formed while the chunk's logits exist and nothing of size (rows, Vd)
    is kept or recomputed for backward. GEMMs run in `cdt` (the autocast dtype under autocast, else
    h's dtype); grads come back in h's and w's dtypes. grad_scale: () the factor the caller
    multiplies `total` by, folded into the gradient in the forward (backward then multiplies by
    grad_total / grad_scale, the upstream factor); shared: a SharedHeadGrad, see there."""

    @staticmethod
    def forward(
        ctx,
        h,
        w,
        tgt,
        tgt_lse,
        weight,
        grad_scale,
        chunk_rows: int,
        need_grad: bool,
        cdt: torch.dtype,
        shared: SharedHeadGrad | None,
    ):
        """Kept whole: one chunked pass computes the loss, the argmax and both gradients while
        each chunk's logits exist; its buffers are what a split would hand around."""
        B, T, H = h.shape
        acc = torch.promote_types(cdt, torch.float32)
        hf, tf, wf = (
            h.reshape(B * T, H).to(cdt),
            tgt.reshape(B * T, -1),
            weight.reshape(B * T),
        )  # (N, H), (N, Vd), (N,)
        lf = tgt_lse.reshape(B * T) if tgt_lse is not None else None  # (N,)
        wc = w.to(cdt)  # (Vd, H)
        chunk = _compiled_ce_chunk() if h.is_cuda else _ce_chunk
        total = torch.zeros((), dtype=acc, device=h.device)
        argmax = torch.empty(B * T, dtype=torch.long, device=h.device)  # (N,)
        grad_h = torch.empty_like(hf) if need_grad else None  # (N, H) in cdt
        grad_w = None  # (Vd, H)
        with torch.autocast(h.device.type, enabled=False):  # every dtype here is explicit
            for a in range(0, B * T, chunk_rows):
                hc = hf[a : a + chunk_rows]  # (c, H)
                lc = lf[a : a + chunk_rows] if lf is not None else None  # (c,)
                ce, am, g = chunk(
                    hc @ wc.T,
                    tf[a : a + chunk_rows],
                    lc,
                    wf[a : a + chunk_rows],
                    grad_scale,
                    need_grad,
                )  # (), (c,), (c, Vd)
                total += ce
                argmax[a : a + chunk_rows] = am
                if need_grad:
                    torch.mm(g, wc, out=grad_h[a : a + chunk_rows])  # (c, H)
                    if (
                        chunk_rows >= B * T
                    ):  # one chunk: the GEMM's own fp32 accumulation, no fp32 round trip
                        if (
                            shared is not None
                            and shared.grad is not None
                            and shared.grad.dtype == cdt
                        ):
                            shared.grad.addmm_(
                                g.T, hc
                            )  # (Vd, H): this step's part added inside the GEMM
                        else:
                            grad_w = g.T @ hc  # (Vd, H) in cdt
                    else:
                        gw = (g.T @ hc).to(acc)  # (Vd, H)
                        grad_w = gw if grad_w is None else grad_w.add_(gw)
        ctx.shared, ctx.index = shared, None
        if need_grad and shared is not None:
            if grad_w is not None:
                shared.grad = (
                    grad_w
                    if shared.grad is None
                    else shared.grad.add_(grad_w.to(shared.grad.dtype))
                )
            grad_w, ctx.index = None, shared.num_calls
            shared.num_calls += 1
        if need_grad:
            ctx.save_for_backward(
                grad_h.reshape(B, T, H).to(h.dtype),
                grad_scale,
                *([] if grad_w is None else [grad_w.to(w.dtype)]),
            )
        return total, argmax.reshape(B, T)

    @staticmethod
    def backward(ctx, grad_total, grad_argmax):
        grad_h, grad_scale, *own = ctx.saved_tensors
        # () the upstream factor (grad_scale was folded into the forward's gradient); a zero
        # grad_scale (a step whose loss weight is 0, e.g. loss_decay**j underflowing) made the
        # gradient 0 already: 0, not 0/0
        f = torch.where(grad_scale != 0, grad_total / grad_scale, torch.zeros_like(grad_total))
        if ctx.shared is None:
            grad_w = own[0] * f.to(own[0].dtype)
        else:  # the unroll's summed head gradient, returned by its first call only
            grad_w = ctx.shared.grad * f.to(ctx.shared.grad.dtype) if ctx.index == 0 else None
        return grad_h * f.to(grad_h.dtype), grad_w, None, None, None, None, None, None, None, None


def fused_soft_ce(
    h: torch.Tensor,
    w: torch.Tensor,
    tgt: torch.Tensor,
    weight: torch.Tensor,
    chunk_rows: int = 4096,
    tgt_lse: torch.Tensor | None = None,
    grad_scale: torch.Tensor | None = None,
    shared: SharedHeadGrad | None = None,
):
    """Same value and gradients as soft_ce (tests/test_train.py), without the checkpointed
    recompute: one head matmul fewer per step and far fewer passes over (rows, Vd) float32 blocks
    (the step's main non-GEMM cost on an H200, docs/history/). The target logits get no gradient
    (they are the frozen target's). tgt_lse: (B, T) log-sum-exp of tgt's rows if known
    (Targets.lse), else computed per chunk. grad_scale: () the factor the caller's loss multiplies
    the result by, if known (folded into the gradient, no scaling pass in backward); shared: one
    SharedHeadGrad for all calls of a TTT unroll (their head gradients summed in the GEMMs)."""
    need = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
    dev = h.device.type
    cdt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else h.dtype
    lse = tgt_lse.detach() if tgt_lse is not None else None
    acc = torch.promote_types(cdt, torch.float32)
    scale = (
        torch.ones((), dtype=acc, device=h.device)
        if grad_scale is None
        else grad_scale.detach().to(acc)
    )
    return _FusedSoftCE.apply(
        h, w, tgt.detach(), lse, weight.detach(), scale, max(1, chunk_rows), need, cdt, shared
    )
