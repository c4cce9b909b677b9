"""Training-time-test attention: at TTT step j, row t attends to

    step-0 keys s <= t of the same document (causal, document-aware), and
    the key of every later step 1..j at the *same* row t (EAGLE-3's diagonal pattern)

which is what vLLM computes when drafting: step j at row t is the query at position pos[t]+j, whose
KV cache holds the context (step-0 keys) plus the j earlier draft tokens of this very row.

Three exact kernels with one signature `fn(q, keys, values) -> (B, nh, T, d)`, built per batch by
`make_ttt_attention(kind, doc_ids)`:
  naive  the full (T, (j+1)T) mask over all concatenated keys (reference; tests only)
  sdpa   CPU/exact fallback: the causal block's scores (T, T) and the j diagonal scores (T, j) go
         through one softmax (equivalently: the two partial log-sum-exps combined); never builds the
         (j+1)T-wide key axis
  flex   torch flex_attention (GPU path, torch.compile'd; forward-only on CPU). Default
         (SPLIT_DIAGONAL): the kernel sees only the step-0 keys under the causal document mask and
         also returns its log-sum-exp; the j diagonal scores are merged in by one small compiled
         kernel (`merge_diagonal`, the sdpa fallback's arithmetic). Every step then calls the same
         (T, T) kernel: no (j+1)T key axis is concatenated, and no 128x128 block is spent on the j
         diagonal keys of each query row. Otherwise: a block mask over the concatenated keys, padded
         to K*T with zeros (never visited: not in the block lists) so one compiled kernel serves
         every step.
"""

from __future__ import annotations

import functools

import torch

try:
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:  # torch < 2.9: flex_attention(return_lse=True)
    _AuxRequest = None


def repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if n == 1 else x.repeat_interleave(n, dim=1)  # (B, kvh*n, T, d)


def causal_doc_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    T = doc_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()  # (T, T)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (causal & same)[:, None]  # (B, 1, T, T)


def naive_ttt_attention(q, keys, values, doc_ids):
    """Reference: concatenate every step's keys and build the full boolean mask."""
    B, nh, T, d = q.shape
    j = len(keys) - 1
    rep = nh // keys[0].shape[1]
    k = repeat_kv(torch.cat(keys, dim=2), rep)  # (B, nh, (j+1)T, d)
    v = repeat_kv(torch.cat(values, dim=2), rep)  # (B, nh, (j+1)T, d)
    eye = torch.eye(T, dtype=torch.bool, device=q.device).expand(B, 1, T, T)  # (B, 1, T, T)
    mask = torch.cat([causal_doc_mask(doc_ids)] + [eye] * j, dim=-1)  # (B, 1, T, (j+1)T)
    acc = torch.promote_types(q.dtype, torch.float32)
    att = (q.to(acc) @ k.to(acc).transpose(-1, -2)) / d**0.5  # (B, nh, T, (j+1)T)
    att = att.masked_fill(~mask, float("-inf")).softmax(-1)  # (B, nh, T, (j+1)T)
    return (att @ v.to(acc)).to(q.dtype)  # (B, nh, T, d)


def sdpa_ttt_attention(q, keys, values, mask):
    """Exact fallback: one softmax over [causal block (T) | j diagonal scores], fp32 statistics."""
    B, nh, T, d = q.shape
    rep = nh // keys[0].shape[1]
    scale = d**-0.5
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax statistics in >= fp32
    k0, v0 = repeat_kv(keys[0], rep), repeat_kv(values[0], rep)  # (B, nh, T, d)
    s0 = (q @ k0.transpose(-1, -2)).to(acc) * scale  # (B, nh, T, T)
    s0 = s0.masked_fill(~mask, float("-inf"))  # (B, nh, T, T)
    if len(keys) == 1:
        return s0.softmax(-1).to(q.dtype) @ v0  # (B, nh, T, d)
    diag = (
        torch.stack([(q * repeat_kv(k, rep)).sum(-1) for k in keys[1:]], -1).to(acc) * scale
    )  # (B, nh, T, j)
    p = torch.cat([s0, diag], dim=-1).softmax(-1)  # (B, nh, T, T+j)
    p0, pd = p[..., :T], p[..., T:]  # (B, nh, T, T), (B, nh, T, j)
    out = p0.to(q.dtype) @ v0  # (B, nh, T, d)
    vd = torch.stack([repeat_kv(v, rep) for v in values[1:]], -1)  # (B, nh, T, d, j)
    return out + (vd * pd[..., None, :].to(q.dtype)).sum(-1)  # (B, nh, T, d)


def merge_diagonal(
    o0: torch.Tensor,
    lse0: torch.Tensor,
    q: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> torch.Tensor:
    """Attention over [causal block | j diagonal keys] from the causal block's result alone: o0 (B,
    nh, T, d) and its log-sum-exp lse0 (B, nh, T) (natural log, scores scaled by d**-0.5), plus the
    j diagonal keys/values (B, kvh, T, d) of steps 1..j at the same row. One softmax over all T+j
    scores, fp32 statistics:
        out = (exp(lse0 - m) o0 + sum_i exp(s_i - m) v_i) / (exp(lse0 - m) + sum_i exp(s_i - m)),
        s_i = q.k_i/sqrt(d)
    Differentiable in every input, lse0 included (flex_attention backpropagates through its returned
    lse)."""
    B, nh, T, d = q.shape
    kvh = keys[0].shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.view(B, kvh, nh // kvh, T, d).to(acc)  # (B, kvh, rep, T, d): GQA without repeating k/v
    scores = [(qg * k[:, :, None].to(acc)).sum(-1) * d**-0.5 for k in keys]  # j x (B, kvh, rep, T)
    l0 = lse0.view(B, kvh, nh // kvh, T).to(acc)  # (B, kvh, rep, T)
    m = functools.reduce(torch.maximum, scores, l0)  # (B, kvh, rep, T)
    w0 = (l0 - m).exp()  # (B, kvh, rep, T)
    ws = [(s - m).exp() for s in scores]  # j x (B, kvh, rep, T)
    z = functools.reduce(torch.add, ws, w0)  # (B, kvh, rep, T)
    out = w0[..., None] * o0.view(B, kvh, nh // kvh, T, d).to(acc)  # (B, kvh, rep, T, d)
    for w, v in zip(ws, values, strict=True):
        out = out + w[..., None] * v[:, :, None].to(acc)  # (B, kvh, rep, T, d)
    return (out / z[..., None]).to(q.dtype).view(B, nh, T, d)  # (B, nh, T, d)


@functools.cache
def _compiled_merge():
    # one small pointwise graph per number of diagonal keys j = 1..K-1 (forward and backward)
    return torch.compile(merge_diagonal, dynamic=False)


def flex_split_attention(q, keys, values, block_mask, compiled: bool):
    """Step j: flex over the step-0 keys (causal, document-aware) with its log-sum-exp, then
    `merge_diagonal` with the j diagonal keys. block_mask: the (T, T) causal document mask
    (`causal_doc_block_mask`), the same at every step."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if compiled else flex_attention
    gqa = q.shape[1] != keys[0].shape[1]
    if _AuxRequest is not None:
        o0, aux = fn(
            q,
            keys[0],
            values[0],
            block_mask=block_mask,
            enable_gqa=gqa,
            return_aux=_AuxRequest(lse=True),
        )
        lse0 = aux.lse  # (B, nh, T)
    else:  # torch < 2.9
        o0, lse0 = fn(
            q, keys[0], values[0], block_mask=block_mask, enable_gqa=gqa, return_lse=True
        )  # (B, nh, T, d), (B, nh, T)
    if len(keys) == 1:
        return o0
    merge = _compiled_merge() if compiled else merge_diagonal
    return merge(o0, lse0, q, keys[1:], values[1:])  # (B, nh, T, d)


def causal_doc_block_mask(doc_ids: torch.Tensor, block_size: int = 128):
    """The (T, T) BlockMask of the step-0 keys: causal within each document
    (`flex_split_attention`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape

    def mask_mod(b, h, qi, kv):
        return (kv <= qi) & (doc_ids[b, kv] == doc_ids[b, qi])

    return create_block_mask(
        mask_mod,
        B,
        None,
        T,
        T,
        device=doc_ids.device,
        BLOCK_SIZE=block_size,
        _compile=doc_ids.is_cuda,
    )


@functools.cache
def _compiled_flex():
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    # one compiled kernel per TTT step (the key length grows with the step): stay under the
    # recompile limit
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False, mode=FLEX_COMPILE_MODE)


def flex_block_masks(doc_ids: torch.Tensor, steps: int, block_size: int = 128):
    """One BlockMask per TTT step j over the (j+1)T concatenated keys (`flex_ttt_attention` with
    padded=False)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape

    def make(j):
        def mask_mod(b, h, qi, kv):
            s, u = kv // T, kv % T
            causal = (u <= qi) & (doc_ids[b, u] == doc_ids[b, qi])
            return ((s == 0) & causal) | ((s > 0) & (u == qi))

        return create_block_mask(
            mask_mod,
            B,
            None,
            T,
            (j + 1) * T,
            device=doc_ids.device,
            BLOCK_SIZE=block_size,
            _compile=doc_ids.is_cuda,
        )  # compiled: never materialises the (T, (j+1)T) mask

    return [make(j) for j in range(steps)]


def padded_block_masks(doc_ids: torch.Tensor, steps: int, block_size: int = 128):
    """One BlockMask per TTT step j, all over the same K*T key axis (keys of steps > j are zero
    padding), all with the SAME mask_mod: the compiled flex kernel sees one shape and one mask
    function at every step and compiles once (forward and backward) instead of K times, and the
    block mask itself is built once (one compile too).

    Step j's mask = the K-step mask restricted to the kv blocks of slots 0..j: the blocks of later
    slots are dropped from the block lists, so the kernel never visits them and their (zero) keys
    never enter the softmax. Exact only when T is a multiple of block_size (no block straddles two
    slots) and only for the compiled kernel, which honours the block lists (eager flex evaluates
    mask_mod densely and would let the padding's diagonal in); benchmarks/step_setup.py's check_flex
    verifies it on the device, values and grads."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    B, T = doc_ids.shape
    if T % block_size:
        raise ValueError(f"padded_block_masks: T={T} is not a multiple of block_size={block_size}")

    def mask_mod(b, h, qi, kv):
        s, u = kv // T, kv % T
        causal = (u <= qi) & (doc_ids[b, u] == doc_ids[b, qi])
        return ((s == 0) & causal) | ((s > 0) & (u == qi))

    full = create_block_mask(
        mask_mod,
        B,
        None,
        T,
        steps * T,
        device=doc_ids.device,
        BLOCK_SIZE=block_size,
        _compile=doc_ids.is_cuda,
    )
    # kv_indices rows list a q block's kv blocks in ascending order first (the rest is filler), so
    # step j keeps the leading entries with index < (j+1)*T/block_size
    n_kv = full.kv_indices.shape[-1]
    pos = torch.arange(n_kv, device=doc_ids.device)  # (n_kv,)

    def count(num, idx, limit):  # num: (B, 1, nq); idx: (B, 1, nq, n_kv)
        listed = pos < num[..., None]  # (B, 1, nq, n_kv)
        return (listed & (idx < limit)).sum(-1).to(num.dtype)  # (B, 1, nq)

    masks = []
    for j in range(steps):
        limit = (j + 1) * T // block_size
        has_full = full.full_kv_num_blocks is not None
        masks.append(
            BlockMask.from_kv_blocks(
                count(full.kv_num_blocks, full.kv_indices, limit),
                full.kv_indices,
                count(full.full_kv_num_blocks, full.full_kv_indices, limit) if has_full else None,
                full.full_kv_indices if has_full else None,
                BLOCK_SIZE=full.BLOCK_SIZE,
                mask_mod=mask_mod,
                seq_lengths=(T, steps * T),
            )
        )
    return masks


def flex_ttt_attention(q, keys, values, block_masks, compiled: bool, padded: bool = False):
    """padded: the keys/values of the steps still to come are zeros, so every step's key axis is K*T
    long (block_masks from `padded_block_masks`); otherwise (j+1)T (`flex_block_masks`)."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if compiled else flex_attention
    j = len(keys) - 1
    if padded and j + 1 < len(block_masks):
        B, kvh, T, d = keys[0].shape
        z = keys[0].new_zeros(B, kvh, (len(block_masks) - 1 - j) * T, d)  # (B, kvh, (K-1-j)T, d)
        keys, values = [*keys, z], [*values, z]
    k = torch.cat(keys, dim=2)  # (B, kvh, (j+1)T or KT, d)
    v = torch.cat(values, dim=2)  # (B, kvh, (j+1)T or KT, d)
    bm = block_masks[j]
    return fn(q, k, v, block_mask=bm, enable_gqa=q.shape[1] != k.shape[1])  # (B, nh, T, d)


#: torch.compile mode of the flex kernel (None: inductor's default block sizes;
#: "max-autotune-no-cudagraphs" times several kernel configurations at compile time and keeps the
#: fastest; benchmarks/train_step.py --flex-compile-mode)
FLEX_COMPILE_MODE: str | None = None

#: default of make_ttt_attention(padded=None) for the compiled flex kernel (benchmarks/train_step.py
#: turns it off when a config fails with it, to retry the per-step key lengths of before)
PAD_KEYS = True

#: flex: the step-0 keys through the kernel and the diagonal keys merged after it
#: (`flex_split_attention`); False: all keys concatenated under one block mask (padded to K*T when
#: PAD_KEYS). benchmarks/train_step.py turns it off when a config fails with it
SPLIT_DIAGONAL = True


def resolve_kind(kind: str, device: torch.device) -> str:
    if kind == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if kind not in ("flex", "sdpa", "naive"):
        raise ValueError(f"attention={kind!r} is not one of auto, flex, sdpa, naive")
    return kind


def make_ttt_attention(
    kind: str,
    doc_ids: torch.Tensor,
    steps: int,
    compiled: bool | None = None,
    padded: bool | None = None,
):
    """The attention callable for one packed batch. doc_ids: (B, T) int, padding rows get their own
    ids. flex only: SPLIT_DIAGONAL (default) = `flex_split_attention`, unless `padded` is True;
    otherwise `padded` (default: when T is a multiple of the block size) = every step's keys padded
    to K*T, one compiled kernel for all steps (`padded_block_masks`), else per-step key lengths
    (`flex_block_masks`)."""
    kind = resolve_kind(kind, doc_ids.device)
    if kind == "naive":
        return functools.partial(naive_ttt_attention, doc_ids=doc_ids)
    if kind == "sdpa":
        return functools.partial(sdpa_ttt_attention, mask=causal_doc_mask(doc_ids))
    bs = 128 if doc_ids.shape[1] >= 128 else 16
    compiled = doc_ids.device.type == "cuda" if compiled is None else compiled
    if SPLIT_DIAGONAL and padded is None:
        return functools.partial(
            flex_split_attention, block_mask=causal_doc_block_mask(doc_ids, bs), compiled=compiled
        )
    if (
        padded is None
    ):  # eager flex (CPU) applies mask_mod densely and ignores the cut block lists: compiled only
        padded = PAD_KEYS and compiled and doc_ids.shape[1] % bs == 0
    masks = (padded_block_masks if padded else flex_block_masks)(doc_ids, steps, block_size=bs)
    return functools.partial(
        flex_ttt_attention, block_masks=masks, compiled=compiled, padded=padded
    )


__all__ = [
    "make_ttt_attention",
    "naive_ttt_attention",
    "sdpa_ttt_attention",
    "flex_ttt_attention",
    "flex_split_attention",
    "merge_diagonal",
]
