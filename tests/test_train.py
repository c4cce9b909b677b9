"""Training: chunked loss == full softmax, normalisation, packing, exact resume, tiny end-to-end
run."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from eagle3.config import TrainConfig, deep_merge
from eagle3.model.draft import DraftConfig, Eagle3Draft
from eagle3.train.attention import make_ttt_attention
from eagle3.train.data import LoaderState, PackedLoader, eval_batches, pack
from eagle3.train.loss import TargetHead, soft_ce
from eagle3.train.step import PackedBatch, summarize, ttt_forward


@pytest.fixture(scope="module")
def captured(tiny_llama, tmp_path_factory):
    from tests.synthetic_capture import capture_samples, frequent_ids, write_vocab

    samples, manifest = capture_samples(
        tiny_llama, num=20, aux_layer_ids=(1, 2, 4), min_len=16, max_len=40
    )
    vocab = write_vocab(tmp_path_factory.mktemp("vocab"), 512, frequent_ids(samples, 200, 512))
    return samples, manifest, vocab


def tiny_cfg(**kw) -> DraftConfig:
    base = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        vocab_size=50,
        draft_vocab_size=20,
        target_hidden_size=32,
        num_aux=2,
    )
    return DraftConfig(**{**base, **kw})


def tiny_setup(seed=0, B=2, T=24):
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = tiny_cfg()
    model = Eagle3Draft(cfg).double()
    draft_ids = torch.randperm(50, generator=g)[:20].sort().values
    model.d2t.copy_(draft_ids - torch.arange(20))
    head = TargetHead(
        torch.rand(32, generator=g, dtype=torch.float64) + 0.5,
        1e-6,
        torch.randn(50, 32, generator=g, dtype=torch.float64),
        draft_ids,
    )
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, 10:] = 1
    doc[1, 18:] = -1
    pos = torch.zeros_like(doc)
    pos[0] = torch.cat([torch.arange(10), torch.arange(T - 10)])
    pos[1] = torch.arange(T)
    batch = PackedBatch(
        torch.randint(0, 50, (B, T), generator=g),
        pos,
        doc,
        torch.rand(B, T, generator=g) < 0.8,
        torch.randn(B, T, 64, generator=g, dtype=torch.float64),
        torch.randn(B, T, 32, generator=g, dtype=torch.float64) * 3,
    )
    return model, head, batch


def ce_inputs(seed: int, T: int, p_supervised: float, dtype=torch.float64):
    """h (2, T, 16) and w (11, 16) leaves, target logits (2, T, 11), 0/1 row weights (2, T)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, T, 16, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(11, 16, generator=g, dtype=dtype, requires_grad=True)
    tgt = torch.randn(2, T, 11, generator=g, dtype=dtype)
    weight = (torch.rand(2, T, generator=g) < p_supervised).to(dtype)
    return h, w, tgt, weight


def test_soft_ce_chunked_equals_full_softmax():
    h, w, tgt, weight = ce_inputs(0, 7, 0.6)
    full = (-(tgt.softmax(-1) * F.log_softmax(h @ w.T, -1)).sum(-1) * weight).sum()
    gh, gw = torch.autograd.grad(full, [h, w])
    for chunk in (1, 3, 100):
        got, am = soft_ce(h, w, tgt, weight, chunk_rows=chunk)
        torch.testing.assert_close(got, full)
        assert torch.equal(am, (h @ w.T).argmax(-1))
        for a, b in zip(torch.autograd.grad(got, [h, w]), (gh, gw), strict=True):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("chunk_rows", [8, 64])  # 64 >= 37 rows: one chunk (grad_w from one GEMM)
def test_fused_soft_ce_equals_soft_ce_values_and_grads(chunk_rows):
    from eagle3.train.loss import fused_soft_ce

    h, w, tgt, weight = ce_inputs(1, 37, 0.7)
    grads = []
    for fn in (soft_ce, fused_soft_ce):
        total, am = fn(h, w, tgt, weight, chunk_rows=chunk_rows)
        (1.7 * total).backward()
        grads.append((total.detach(), am, h.grad.clone(), w.grad.clone()))
        h.grad = w.grad = None
    total, am = fused_soft_ce(
        h, w, tgt, weight, chunk_rows=chunk_rows, tgt_lse=tgt.logsumexp(-1)
    )  # Targets.lse
    (1.7 * total).backward()
    grads.append((total.detach(), am, h.grad.clone(), w.grad.clone()))
    h.grad = w.grad = None
    (t1, a1, gh1, gw1), *rest = grads
    for t2, a2, gh2, gw2 in rest:
        assert torch.allclose(t1, t2, rtol=1e-12) and torch.equal(a1, a2)
        assert torch.allclose(gh1, gh2, atol=1e-12) and torch.allclose(gw1, gw2, atol=1e-12)
    with torch.no_grad():  # evaluation: no gradient work, same value
        assert torch.allclose(fused_soft_ce(h, w, tgt, weight, chunk_rows=8)[0], t1, rtol=1e-12)


@pytest.mark.parametrize("chunk_rows", [8, 128])
def test_fused_soft_ce_under_bf16_autocast(chunk_rows):
    """fp32 leaves under bf16 autocast (the trainer's mixed precision): GEMMs in bf16, fp32 softmax
    statistics and loss; value and grads agree with the autograd loss at bf16 tolerance (several
    chunks, and one)."""
    from eagle3.train.loss import fused_soft_ce

    h, w, tgt, weight = ce_inputs(2, 37, 0.7, dtype=torch.float32)
    res = []
    for fn in (soft_ce, fused_soft_ce):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total, _ = fn(h, w, tgt, weight, chunk_rows=chunk_rows)
        assert total.dtype == torch.float32
        res.append((total.detach(), *torch.autograd.grad(total, [h, w])))
    (t1, gh1, gw1), (t2, gh2, gw2) = res
    torch.testing.assert_close(t2, t1, rtol=1e-3, atol=1e-3)
    for a, b in ((gh2, gh1), (gw2, gw1)):
        assert (a - b).abs().max() <= 2e-2 * b.abs().max(), (a - b).abs().max()


@pytest.mark.parametrize(
    "chunk_rows", [7, 4096]
)  # several chunks per step (fp32 head-grad sum), and one (in-GEMM sum)
def test_ttt_forward_fused_loss_equals_unfused(chunk_rows):
    """The fused loss (target log-sum-exp once per batch, the head's gradient summed over the steps
    by SharedHeadGrad) against the autograd reference; a second backward through the kept graph
    gives the same grads."""
    model, head, batch = tiny_setup(seed=3)
    res = []
    for fused in (True, False):
        model.zero_grad()
        out = ttt_forward(
            model,
            batch,
            head,
            steps=3,
            attention="naive",
            loss_chunk_rows=chunk_rows,
            fused_loss=fused,
        )
        (0.5 * out.loss).backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        model.zero_grad()
        (
            0.5 * out.loss
        ).backward()  # the upstream factor (0.5) reaches the head's summed gradient too
        assert all(
            torch.equal(a, p.grad)
            for a, p in zip(
                first, [p for p in model.parameters() if p.grad is not None], strict=True
            )
        )
        res.append(
            (
                out.loss.detach(),
                out.stats,
                [p.grad.clone() for p in model.parameters() if p.grad is not None],
            )
        )
    assert torch.allclose(res[0][0], res[1][0], rtol=1e-10) and torch.allclose(
        res[0][1], res[1][1], rtol=1e-10
    )
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(res[0][2], res[1][2], strict=True))


def test_fused_loss_with_a_zero_step_weight_matches_unfused():
    """loss_decay 0 weighs steps 1.. by 0 (their grad_scale is 0): the fused loss's gradients stay
    finite and equal the autograd reference's (the upstream factor is not recovered as 0/0)."""
    model, head, batch = tiny_setup(seed=6)
    grads = []
    for fused in (True, False):
        model.zero_grad()
        out = ttt_forward(
            model, batch, head, steps=3, loss_decay=0.0, attention="naive", fused_loss=fused
        )
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    for n in grads[1]:
        assert torch.isfinite(grads[0][n]).all() and torch.allclose(
            grads[0][n], grads[1][n], atol=1e-10
        ), n


def test_ttt_forward_fused_loss_under_bf16_autocast():
    """The trainer's mixed precision (fp32 master weights, bf16 autocast; the matrices cast once per
    unroll): the fused loss's head gradient, summed over the steps inside bf16 GEMMs, agrees with
    the autograd reference."""
    model, head, batch = tiny_setup(seed=4)
    model.float()
    batch = batch.to("cpu", torch.float32)
    head = TargetHead(head.norm_weight.float(), head.eps, head.lm_head.float(), head.draft_ids)
    res = []
    for fused in (True, False):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttt_forward(
                model,
                batch,
                head,
                steps=3,
                attention="sdpa",
                loss_chunk_rows=4096,
                fused_loss=fused,
            )
        out.loss.backward()
        res.append(
            (
                out.loss.item(),
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    (l0, g0), (l1, g1) = res
    assert l0 == pytest.approx(l1, rel=1e-3) and set(g0) == set(g1) and "lm_head.weight" in g0
    for n in g0:
        assert ((g0[n] - g1[n]).abs().max() / g1[n].abs().max()).item() < 3e-2, n


def is_copy(ids, doc, b, p):
    """Token p of row b continues a span repeated earlier in its document: the 3-gram ending at p
    (one document's) also ends at an earlier q of that document. Explicit loops, for the
    references."""
    if p < 2 or doc[b, p] < 0 or not doc[b, p - 2] == doc[b, p]:
        return False
    return any(
        doc[b, q - 2] == doc[b, q] == doc[b, p]
        and torch.equal(ids[b, q - 2 : q + 1], ids[b, p - 2 : p + 1])
        for q in range(2, p)
    )


def reference_loss(
    model,
    head,
    batch,
    steps,
    decay,
    temperature=1.0,
    feature_weight=0.0,
    mid_weight=0.0,
    mid_block=0,
    copy_weight=1.0,
    step_weight=None,
    accept_until_fail=False,
):
    """Independent, unchunked: full target softmax, explicit shifted loops, naive attention. The
    feature term uses the normed outputs: at init the final norm's weight is 1, so they are the
    RMS-normalised pre-norm hidden. step_weight (B, T, K): row t's weight at step j;
    accept_until_fail: step j's CE at row t times the draft's probability of the target's argmax
    token at each step i < j there (not in the row count)."""
    B, T = batch.input_ids.shape
    x = batch.last_hidden
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.eps) * head.norm_weight
    full = xn @ head.lm_head.T  # (B, T, V)
    sub = full[..., head.draft_ids]  # (B, T, Vd)
    attn = make_ttt_attention("naive", batch.doc_ids, steps)
    ids = [
        torch.cat([batch.input_ids[:, 1 + j :], torch.zeros(B, 1 + j, dtype=torch.long)], 1)
        for j in range(steps)
    ]
    hidden, cache, outs, mids = model.combine(batch.aux), model.new_cache(), [], []
    for j in range(steps):
        states = []
        out, hidden = model.step(ids[j], hidden, batch.positions + j, cache, attn, states)
        outs.append(out)
        mids.append(states[0])

    def unit(v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)

    block = batch.aux.unflatten(-1, (model.cfg.num_aux, -1))[:, :, mid_block]  # (B, T, Ht)
    total = 0.0
    for j, out in enumerate(outs):
        logq = F.log_softmax(model.lm_head(out) / temperature, -1)
        num, den, feat, mid, n_feat = 0.0, 0, 0.0, 0.0, 0
        for b in range(B):
            for t in range(T):
                r = t + 1 + j
                if r + 1 >= T or batch.doc_ids[b, t] < 0:
                    continue
                if (
                    not (batch.doc_ids[b, r] == batch.doc_ids[b, t] == batch.doc_ids[b, r + 1])
                    or not batch.loss_mask[b, r + 1]
                ):
                    continue
                feat, n_feat = feat + (out[b, t] - unit(x[b, r])).pow(2).mean(), n_feat + 1
                mid = mid + (unit(mids[j][b, t]) - unit(block[b, r])).pow(2).mean()
                if (
                    full[b, r].argmax() not in head.draft_ids
                ):  # out-of-draft-vocab target: excluded from the loss
                    continue
                w = copy_weight if is_copy(batch.input_ids, batch.doc_ids, b, r + 1) else 1.0
                w = w * (1.0 if step_weight is None else float(step_weight[b, t, j]))
                reach = 1.0
                for i in range(j if accept_until_fail else 0):  # P(draft's token i = target's)
                    tok = int(full[b, t + 1 + i].argmax())
                    hit = (head.draft_ids == tok).nonzero()
                    q = F.softmax(model.lm_head(outs[i][b, t]), -1)
                    reach = reach * (q[int(hit[0, 0])].item() if len(hit) else 0.0)
                num = num - w * reach * ((sub[b, r] / temperature).softmax(-1) * logq[b, t]).sum()
                den += w
        total = total + decay**j * (
            num / max(den, 1) + (feature_weight * feat + mid_weight * mid) / max(n_feat, 1)
        )
    return total


def test_ttt_loss_normalisation_matches_reference():
    model, head, batch = tiny_setup()
    out = ttt_forward(
        model, batch, head, steps=3, loss_decay=0.7, attention="sdpa", loss_chunk_rows=5
    )
    ref = reference_loss(model, head, batch, 3, 0.7)
    torch.testing.assert_close(out.loss, torch.as_tensor(ref, dtype=out.loss.dtype))
    # some rows are out-of-draft-vocab: they are counted as valid (metrics) but not in the loss
    assert (out.stats[:, 5] < out.stats[:, 0]).all()
    # normalisation is per valid token: appending a padding tail changes nothing
    pad = 7
    padded = PackedBatch(
        F.pad(batch.input_ids, (0, pad)),
        F.pad(batch.positions, (0, pad)),
        F.pad(batch.doc_ids, (0, pad), value=-1),
        F.pad(batch.loss_mask, (0, pad)),
        F.pad(batch.aux, (0, 0, 0, pad)),
        F.pad(batch.last_hidden, (0, 0, 0, pad)),
    )
    out2 = ttt_forward(model, padded, head, steps=3, loss_decay=0.7, attention="naive")
    torch.testing.assert_close(out2.loss, out.loss)
    torch.testing.assert_close(out2.stats, out.stats)


@pytest.mark.parametrize(
    "temperature,feature_weight,mid_weight",
    [
        (0.5, 0.0, 0.0),
        (2.0, 0.0, 0.0),
        (1.0, 0.3, 0.0),
        (0.5, 0.3, 0.0),
        (1.0, 0.0, 0.4),
        (1.0, 0.3, 0.4),
    ],
)
def test_distill_temperature_and_feature_losses_match_reference(
    temperature, feature_weight, mid_weight
):
    model, head, batch = tiny_setup(seed=1)
    kw = dict(steps=3, loss_decay=0.7, attention="naive", loss_chunk_rows=5)
    out = ttt_forward(
        model,
        batch,
        head,
        temperature=temperature,
        feature_weight=feature_weight,
        mid_feature_weight=mid_weight,
        mid_target_block=1,
        **kw,
    )
    ref = reference_loss(
        model,
        head,
        batch,
        3,
        0.7,
        temperature=temperature,
        feature_weight=feature_weight,
        mid_weight=mid_weight,
        mid_block=1,
    )
    torch.testing.assert_close(out.loss, torch.as_tensor(ref, dtype=out.loss.dtype))
    plain = ttt_forward(model, batch, head, **kw)
    assert not torch.allclose(
        out.loss, plain.loss
    )  # each term changes the loss, not only the metrics
    torch.testing.assert_close(
        out.stats[:, :4], plain.stats[:, :4]
    )  # argmax metrics are temperature-free
    assert (out.stats[:, 6] > 0).all() == (
        feature_weight > 0
    )  # the feature error is reported when it ran
    out.loss.backward()
    assert model.fc.weight.grad is not None and model.fc.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    "with_step_weight,accept_until_fail",
    [(True, False), (False, True), (True, True)],
    ids=["step_weight", "accept_until_fail", "both"],
)
def test_row_weights_match_reference(with_step_weight, accept_until_fail):
    """batch.step_weight (refine's replayed rounds) and loss_weighting=accept_until_fail weigh the
    rows as the explicit reference does, fused and unfused, and only the loss: the argmax metrics
    stay as they were."""
    model, head, batch = tiny_setup(seed=2)
    g = torch.Generator().manual_seed(3)
    if with_step_weight:
        shape = (*batch.input_ids.shape, 3)
        batch.step_weight = torch.randint(0, 3, shape, generator=g).double()  # (B, T, K)
    kw = dict(
        steps=3,
        loss_decay=0.7,
        attention="naive",
        loss_chunk_rows=5,
        loss_weighting="accept_until_fail" if accept_until_fail else "uniform",
    )
    ref = reference_loss(
        model,
        head,
        batch,
        3,
        0.7,
        step_weight=batch.step_weight,
        accept_until_fail=accept_until_fail,
    )
    for fused in (True, False):
        out = ttt_forward(model, batch, head, fused_loss=fused, **kw)
        torch.testing.assert_close(out.loss, torch.as_tensor(ref, dtype=out.loss.dtype))
    unweighted = PackedBatch(**{**batch.__dict__, "step_weight": None})
    plain = ttt_forward(model, unweighted, head, steps=3, loss_decay=0.7, attention="naive")
    assert not torch.allclose(out.loss, plain.loss)
    torch.testing.assert_close(out.stats[:, :4], plain.stats[:, :4])


def test_accept_on_next_token_scores_the_sequence_token():
    """accept_on=next_token compares step j at row t with token t+2+j: on a sequence that IS the
    target's greedy continuation it equals the target_argmax criterion, and on another sequence
    it scores exactly the rows whose token t+2+j is the draft's."""
    model, head, batch = tiny_setup(seed=4)
    model.lm_head.weight.data.zero_()  # every draft token is draft id 0: right where that is true
    x = batch.last_hidden
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.eps) * head.norm_weight
    argmax = (normed @ head.lm_head.T).argmax(-1)  # (B, T) the target's argmax at each row
    token0 = int(head.draft_ids[0])
    argmax[:, ::2] = token0  # many rows where the draft's token is the target's
    batch.target_argmax = argmax
    ids = torch.cat([batch.input_ids[:, :1], argmax[:, :-1]], 1)  # token t+1 = the argmax at row t
    greedy = PackedBatch(**{**batch.__dict__, "input_ids": ids})
    by_argmax = ttt_forward(model, greedy, head, steps=3, attention="naive", return_correct=True)
    by_token = ttt_forward(
        model, greedy, head, steps=3, attention="naive", return_correct=True, accept_on="next_token"
    )
    assert by_argmax.correct.any() and torch.equal(by_token.correct, by_argmax.correct)
    other = ttt_forward(
        model, batch, head, steps=3, attention="naive", return_correct=True, accept_on="next_token"
    )
    want = batch.input_ids == token0  # step j at row t is right iff token t+2+j is the draft's
    for j in range(3):
        expect = torch.zeros_like(want)
        expect[:, : -(2 + j)] = want[:, 2 + j :]
        assert torch.equal(other.correct[j], expect & other.valid[j]), j


def test_copy_rows_match_explicit_loops():
    from eagle3.train.step import copy_rows

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3, (3, 40), generator=g)  # 3 symbols: many 3-grams repeat
    doc = torch.zeros(3, 40, dtype=torch.long)
    doc[0, 17:] = 1  # a second document: its 3-grams do not match the first's
    doc[1, 30:] = -1  # padding
    doc[2, 5:], doc[2, 6:] = 1, 2  # a one-token document
    ids[0, 17:20] = ids[0, 0:3]  # a repeat across documents only: not a copy
    got = copy_rows(ids, doc, vocab_size=3)
    want = torch.tensor([[is_copy(ids, doc, b, p) for p in range(40)] for b in range(3)])
    assert torch.equal(got, want)
    assert 10 < want.sum() < 3 * 40 - 10  # the case exercises both answers
    assert not got[1, 30:].any()
    far = doc.clone()
    far[0, 17:] = (
        # doc ids need not be row-local: row * T + doc id would put this and row 1's doc 0 together
        40
    )
    assert torch.equal(copy_rows(ids, far, vocab_size=3), want)
    with pytest.raises(ValueError, match="2\\*\\*21"):
        copy_rows(ids, doc, vocab_size=2**21)


def test_copy_weight_matches_reference():
    """copy_weight scales the CE of the copy rows (the per-step mean is over the weighted rows);
    metrics unchanged."""
    model, head, batch = tiny_setup(seed=4)
    batch.input_ids[:] = batch.input_ids % 4  # small alphabet: some 3-grams repeat
    kw = dict(steps=3, loss_decay=0.7, attention="naive", loss_chunk_rows=5)
    out = ttt_forward(model, batch, head, copy_weight=5.0, **kw)
    ref = reference_loss(model, head, batch, 3, 0.7, copy_weight=5.0)
    torch.testing.assert_close(out.loss, torch.as_tensor(ref, dtype=out.loss.dtype))
    plain = ttt_forward(model, batch, head, **kw)
    assert not torch.allclose(out.loss, plain.loss)
    torch.testing.assert_close(out.stats[:, :4], plain.stats[:, :4])
    torch.testing.assert_close(
        ttt_forward(model, batch, head, copy_weight=1.0, **kw).loss, plain.loss
    )


def test_step_metrics_match_a_per_step_reference():
    """ttt_forward forms every step's masks and metrics at once (_step_masks, after the loop); this
    is the explicit per-step version: valid rows, top-1 agreement, rows whose earlier steps were all
    right (cond), loss rows."""
    model, head, batch = tiny_setup(seed=2)
    steps = 3
    batch.loss_mask[0, 5:9] = 0  # some unsupervised rows inside a document
    out = ttt_forward(
        model, batch, head, steps=steps, attention="naive", loss_chunk_rows=5, return_correct=True
    )
    doc, T = batch.doc_ids, batch.doc_ids.shape[1]
    x = batch.last_hidden
    full = (
        x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + head.eps) * head.norm_weight
    ) @ head.lm_head.T
    tgt_argmax, in_vocab = full.argmax(-1), torch.isin(full.argmax(-1), head.draft_ids)  # (B, T)
    attn = make_ttt_attention("naive", doc, steps)
    hidden, cache = model.combine(batch.aux), model.new_cache()
    joint = doc >= 0
    for j in range(steps):
        ids = torch.cat(
            [batch.input_ids[:, 1 + j :], torch.zeros(doc.shape[0], 1 + j, dtype=torch.long)], 1
        )
        o, hidden = model.step(ids, hidden, batch.positions + j, cache, attn)
        am = model.lm_head(o).argmax(-1)  # (B, T) draft ids
        valid = torch.zeros_like(joint)
        loss_rows = 0
        for b, t in itertools.product(range(doc.shape[0]), range(T)):
            r = t + 1 + j
            if (
                r + 1 < T
                and doc[b, t] >= 0
                and doc[b, r] == doc[b, t] == doc[b, r + 1]
                and batch.loss_mask[b, r + 1]
            ):
                valid[b, t] = True
                loss_rows += int(in_vocab[b, r])
        shifted = F.pad(tgt_argmax, (0, 1 + j), value=-1)[
            :, 1 + j :
        ]  # (B, T): the target's token at row t+1+j
        correct = ((am + model.d2t[am]) == shifted) & valid
        cond = joint & valid
        want = [valid.sum(), correct.sum(), cond.sum(), (cond & correct).sum()]
        assert out.stats[j, :4].tolist() == [float(v) for v in want], j
        assert out.stats[j, 5].item() == loss_rows
        assert torch.equal(out.correct[j], correct) and torch.equal(out.valid[j], valid)
        joint = joint & correct
    assert (
        out.stats[0, 0] > 0 and (out.stats[1:, 2] < out.stats[1:, 0]).any()
    )  # the chain cut some rows


def test_metrics_summary():
    # step 0: 10 valid, 8 correct; step 1: 10 valid, 5 correct, 8 rows whose step 0 was right, 4 of
    # them right
    stats = torch.tensor([[10, 8, 10, 8, 20.0, 10, 0], [10, 5, 8, 4, 30.0, 10, 0]])
    m = summarize(stats)
    assert m["acc_0"] == 0.8 and m["acc_1"] == 0.5 and m["cond_acc_1"] == 0.5
    assert m["sim_accept_len"] == pytest.approx(0.8 + 0.8 * 0.5)
    assert m["loss_1"] == 3.0
    assert "feat_0" not in m  # feature error only reported when the feature loss ran
    stats[:, 6] = torch.tensor([5.0, 8.0])
    assert summarize(stats)["feat_1"] == 0.8


def fake_samples(lengths, H=4, n_aux=2):
    return [
        {
            "input_ids": torch.arange(n) + 100 * i,
            "loss_mask": torch.ones(n, dtype=torch.int8),
            "aux_hidden_states": torch.full((n, n_aux, H), float(i)),
            "last_hidden_states": torch.zeros(n, H),
            "sample_id": str(i),
        }
        for i, n in enumerate(lengths)
    ]


def test_packing_is_document_aware_and_resumable():
    s = fake_samples([5, 3, 9, 4, 12, 2])
    row = pack([s[0], s[1]], 10)
    assert row["doc_ids"].tolist() == [0] * 5 + [1] * 3 + [-1] * 2
    assert row["positions"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 0]
    assert row["input_ids"][5:8].tolist() == [100, 101, 102] and not row["loss_mask"][8:].any()
    assert pack([s[4]], 10)["positions"].tolist() == list(range(10))  # truncated to the row
    a = PackedLoader(s, range(6), 10, 2, seed=3)
    first = [next(a) for _ in range(3)]
    b = PackedLoader(s, range(6), 10, 2, seed=3)
    next(b)
    c = PackedLoader(s, range(6), 10, 2, seed=3, state=LoaderState(b.state.epoch, b.state.cursor))
    for want in first[1:]:
        got = next(c)
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.doc_ids, want.doc_ids)
    assert sum(int(b.doc_ids.max()) + 1 for b in eval_batches(s, [0, 1, 2], 10, 1)) == 3


def test_target_argmax_once_per_sample_gives_the_same_step():
    """The argmax computed once per sample (PackedBatch.target_argmax) = the one the step computes
    from the full head; the step then reads only the head's draft-vocab rows and its loss, stats and
    gradients are unchanged."""
    from eagle3.train.loss import compute_target_argmax, compute_targets

    model, head, batch = tiny_setup()
    B, T = batch.input_ids.shape
    ref = compute_targets(head, batch.last_hidden, 4)
    am = compute_target_argmax(head, batch.last_hidden.reshape(B * T, -1), chunk_rows=7).reshape(
        B, T
    )  # (B, T)
    assert torch.equal(am, ref.argmax[:, :T])
    got = compute_targets(head, batch.last_hidden, 4, argmax=am)
    for a, b in (
        (got.logits, ref.logits),
        (got.argmax, ref.argmax),
        (got.in_vocab, ref.in_vocab),
        (got.lse, ref.lse),
    ):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(
        ref.lse, ref.logits.logsumexp(-1)
    )  # per row of the stored logits, padding rows too
    assert 0 < int(ref.in_vocab.sum()) < B * T  # both kinds of rows occur: the mask is exercised
    fast = PackedBatch(
        *(
            getattr(batch, f)
            for f in ("input_ids", "positions", "doc_ids", "loss_mask", "aux", "last_hidden")
        ),
        target_argmax=am,
    )
    outs = []
    for b in (batch, fast):
        model.zero_grad()
        out = ttt_forward(model, b, head, steps=3, attention="naive")
        out.loss.backward()
        outs.append(
            (
                out.loss.detach(),
                out.stats,
                [p.grad.clone() for p in model.parameters() if p.grad is not None],
            )
        )
    torch.testing.assert_close(outs[0][0], outs[1][0])
    torch.testing.assert_close(outs[0][1], outs[1][1])
    for a, b in zip(outs[0][2], outs[1][2], strict=True):
        torch.testing.assert_close(a, b)


def test_attach_target_argmax_packs_with_padding_and_truncation(captured, tmp_path):
    from tests.synthetic_capture import write_captured

    from eagle3.train.data import attach_target_argmax, load_samples, pack_batch
    from eagle3.train.loss import compute_target_argmax

    samples, manifest, _ = captured
    ds = load_samples(write_captured(tmp_path / "cap", samples[:5], manifest, shard_samples=2))
    g = torch.Generator().manual_seed(1)
    Ht = samples[0]["last_hidden_states"].shape[-1]
    head = TargetHead(
        torch.ones(Ht), 1e-6, torch.randn(512, Ht, generator=g), torch.arange(0, 512, 3)
    )
    with_am = attach_target_argmax(ds, head, "cpu", chunk_tokens=50)  # several flushes
    for i in range(5):
        want = compute_target_argmax(
            head, torch.as_tensor(samples[i]["last_hidden_states"]).float()
        )
        assert with_am[i]["target_argmax"].dtype == torch.int32 and torch.equal(
            with_am[i]["target_argmax"].long(), want
        )
    n0, n1 = len(samples[0]["input_ids"]), len(samples[1]["input_ids"])
    T = n0 + n1 // 2  # the second sample is truncated, the second row padded
    b = pack_batch([[with_am[0], with_am[1]], [with_am[2]]], T)
    assert (
        b.target_argmax[0].tolist()
        == with_am[0]["target_argmax"].tolist() + with_am[1]["target_argmax"][: T - n0].tolist()
    )
    n2 = min(len(samples[2]["input_ids"]), T)
    assert (b.target_argmax[1, n2:] == -1).all() and b.target_argmax[1, :n2].tolist() == with_am[2][
        "target_argmax"
    ][:n2].tolist()
    assert (
        pack_batch([[ds[0]]], T).target_argmax is None
    )  # without it the step computes the argmax itself


_SHARDED_ARGMAX = """
import sys
import torch
from eagle3.train import parallel
from eagle3.train.data import attach_target_argmax, load_samples
from eagle3.train.loss import TargetHead
from eagle3.artifacts import DraftVocab
from eagle3.weights import load_target_tensors
from eagle3.train.trainer import with_target_argmax

captured, target, vocab, out = sys.argv[1:]
d = parallel.setup("cpu")
t = load_target_tensors(target)
d2t, _ = DraftVocab.load(vocab).torch_maps()
head = TargetHead(t["norm"], 1e-6, t["lm_head"], torch.arange(d2t.numel()) + d2t)
samples = load_samples(captured)
got = with_target_argmax(samples, head, d)
want = attach_target_argmax(samples, head, "cpu")
ok = all(torch.equal(got[i]["target_argmax"], want[i]["target_argmax"])
         for i in range(len(samples)))
open(f"{out}.{d.rank}", "w").write(f"{ok} {len(samples)}")
parallel.teardown(d)
"""


def test_target_argmax_is_computed_in_shares_across_ranks(captured, tiny_llama, tmp_path):
    """Under torchrun each rank computes every world-th sample's argmax and all ranks end with the
    whole table, equal to one process's; then `eagle3 train` runs through DDP on 2 CPU processes
    (gloo) with it."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.synthetic_capture import write_captured

    samples, manifest, vocab = captured
    cap = write_captured(tmp_path / "cap", samples[:9], manifest, shard_samples=4)
    script = tmp_path / "sharded.py"
    script.write_text(_SHARDED_ARGMAX)
    root = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(root / "src"), str(root)]), OMP_NUM_THREADS="1"
    )
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    p = subprocess.run(
        [*run, str(script), str(cap), str(tiny_llama), str(vocab), str(tmp_path / "ok")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert [(tmp_path / f"ok.{r}").read_text() for r in (0, 1)] == ["True 9", "True 9"]
    p = subprocess.run(
        [
            *run,
            "-m",
            "eagle3.cli",
            "train",
            "--target",
            str(tiny_llama),
            "--captured",
            str(cap),
            "--vocab",
            str(vocab),
            "--out",
            str(tmp_path / "ddp"),
            "--max-steps",
            "2",
            "--device",
            "cpu",
            "--loader-max-seq-len",
            "64",
            "--loss-ttt-steps",
            "2",
            "--checkpoint-eval-every",
            "2",
            "--loader-val-fraction",
            "0.2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert (
        "target argmax of 9 samples (5 on this rank)" in p.stderr
        and (tmp_path / "ddp" / "final").is_dir()
    )


def _cfg(tmp, tiny_llama, vocab, **kw):
    base = dict(
        target=str(tiny_llama),
        captured="in-memory",
        vocab=str(vocab),
        out=tmp,
        max_steps=4,
        optimizer={"lr": 1e-3},
        schedule={"warmup_steps": 1},
        loader={"max_seq_len": 64, "val_fraction": 0.2},
        loss={"ttt_steps": 2},
        checkpoint={"eval_every": 2, "save_every": 2, "log_every": 1},
        device="cpu",
    )
    return TrainConfig(**deep_merge(base, kw))


@pytest.mark.parametrize(
    "extra",
    [{}, {"checkpoint": {"ema_decay": 0.5}, "draft": {"dropout": 0.1}}],
    ids=["plain", "ema+dropout"],
)
def test_resume_is_exact(captured, tiny_llama, tmp_path, extra):
    from safetensors.torch import load_file

    from eagle3.train import run_train

    samples, manifest, vocab = captured
    straight = run_train(
        _cfg(tmp_path / "a", tiny_llama, vocab, **extra), samples=samples, manifest=manifest
    )
    half = run_train(
        _cfg(tmp_path / "b", tiny_llama, vocab, **extra),
        samples=samples,
        manifest=manifest,
        stop_after=2,
    )
    assert half.steps == 2 and not (tmp_path / "b" / "final").exists()
    rest = run_train(
        _cfg(tmp_path / "b", tiny_llama, vocab, **extra), samples=samples, manifest=manifest
    )
    assert rest.steps == straight.steps == 4
    wa, wb = (
        load_file(str(straight.final_dir / "model.safetensors")),
        load_file(str(rest.final_dir / "model.safetensors")),
    )
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    ckpt = tmp_path / "a" / "checkpoints" / "step-4"
    # the checkpoint holds the average (what export serves) and the raw weights (what training
    # resumes)
    if extra:
        avg, raw = (
            load_file(str(ckpt / "model.safetensors")),
            load_file(str(ckpt / "raw.safetensors")),
        )
        assert torch.equal(avg["fc.weight"], wa["fc.weight"]) and not torch.equal(
            raw["fc.weight"], avg["fc.weight"]
        )
    else:
        assert not (ckpt / "raw.safetensors").exists()
    la = [
        json.loads(x) for x in (tmp_path / "a" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    lb = [
        json.loads(x) for x in (tmp_path / "b" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]


def test_a_resumed_run_logs_each_step_once(captured, tiny_llama, tmp_path):
    """A run that logged steps 3-4 and died before checkpointing step 4 is resumed from step 2: it
    logs 3-4 again, so metrics.jsonl drops the lost run's 3-4 first and TensorBoard's events are
    written anew (no step twice)."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from eagle3.train import run_train

    samples, manifest, vocab = captured
    out = tmp_path / "run"
    run_train(_cfg(out, tiny_llama, vocab), samples=samples, manifest=manifest)
    shutil.rmtree(
        out / "checkpoints" / "step-4"
    )  # the crash: steps 3-4 logged, their checkpoint never written
    shutil.rmtree(out / "final")
    run_train(_cfg(out, tiny_llama, vocab), samples=samples, manifest=manifest)
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    keys = [(r["step"], r["split"]) for r in rows]
    assert len(keys) == len(set(keys)) and [s for s, sp in keys if sp == "train"] == [1, 2, 3, 4], (
        keys
    )
    events = sorted((out / "tb").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("train/loss")]
    assert len(events) == 1 and steps == [1, 2, 3, 4], (events, steps)


def test_tiny_end_to_end_reduces_loss(captured, tiny_llama, tmp_path):
    from eagle3.train import run_train

    samples, manifest, vocab = captured
    cfg = _cfg(
        tmp_path,
        tiny_llama,
        vocab,
        max_steps=24,
        optimizer={"lr": 5e-3},
        schedule={"warmup_steps": 2},
        checkpoint={"eval_every": 12, "save_every": 12, "log_every": 4},
        loss={"decay": 0.8},
    )
    res = run_train(cfg, samples=samples, manifest=manifest)
    logs = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in logs if r["split"] == "train"]
    val = [r for r in logs if r["split"] == "val"]
    assert train[-1]["loss"] < train[0]["loss"] - 0.05
    assert val[-1]["loss"] < val[0]["loss"] + 1e-6
    assert {"acc_0", "cond_acc_1", "sim_accept_len", "lr", "grad_norm"} <= train[-1].keys()
    for d in ("checkpoints/step-12", "checkpoints/step-24", "final", "best"):
        assert (tmp_path / d / "model.safetensors").is_file() and (
            tmp_path / d / "eagle3_draft.json"
        ).is_file()
    assert (tmp_path / "checkpoints/step-24/optimizer.pt").is_file() and (
        tmp_path / "curves.png"
    ).stat().st_size > 0
    assert any((tmp_path / "tb").iterdir())
    meta = res.metadata
    assert meta["aux_layer_ids"] == [1, 2, 4] and meta["target_hidden_size"] == 128
    assert (
        meta["draft_config"]["num_aux"] == 3
        and meta["draft_vocab_size"] == 200
        and meta["target_vocab_size"] == 512
    )
    recorded = meta["train_config"]
    assert recorded["optimizer"]["lr"] == 5e-3 and recorded["loss"]["supervise"] == "assistant"


def test_captured_dir_is_read_lazily_and_exactly(captured, tmp_path):
    from tests.synthetic_capture import write_captured

    from eagle3.train.data import CapturedDataset, load_samples

    samples, manifest, _ = captured
    path = write_captured(tmp_path / "cap", samples[:7], manifest, shard_samples=3)
    ds = load_samples(path)
    assert isinstance(ds, CapturedDataset) and len(ds) == 7
    assert ds.manifest.aux_layer_ids == [1, 2, 4]
    for i in (0, 3, 6):
        for k in ("input_ids", "aux_hidden_states", "last_hidden_states"):
            assert torch.equal(ds[i][k], torch.as_tensor(samples[i][k])), (i, k)
        assert torch.equal(
            ds[i]["loss_mask"].long(), torch.as_tensor(samples[i]["loss_mask"]).long()
        )
        assert ds[i]["sample_id"] == samples[i]["sample_id"]


def test_several_captures_train_as_one(captured, tiny_llama, tmp_path):
    """`captured="A,B"` (captures made in parallel, or data added later) trains exactly as one
    capture of the same samples, memory-mapped and preloaded; export checks the combined manifest; a
    capture of another layer set is refused before training, naming the field and both dirs."""
    from safetensors.torch import load_file
    from tests.synthetic_capture import write_captured

    from eagle3.config import ConfigError, ExportConfig
    from eagle3.export import run_export
    from eagle3.train import run_train

    samples, manifest, vocab = captured
    one = write_captured(tmp_path / "one", samples, manifest, shard_samples=6)
    a = write_captured(tmp_path / "a", samples[:9], manifest, shard_samples=4)
    b = write_captured(tmp_path / "b", samples[9:], manifest, shard_samples=5)
    for preload in (False, True):
        ra = run_train(
            _cfg(
                tmp_path / f"one-{preload}",
                tiny_llama,
                vocab,
                captured=str(one),
                loader={"preload": preload},
            )
        )
        rb = run_train(
            _cfg(
                tmp_path / f"ab-{preload}",
                tiny_llama,
                vocab,
                captured=f"{a},{b}",
                loader={"preload": preload},
            )
        )
        wa = load_file(str(ra.final_dir / "model.safetensors"))
        wb = load_file(str(rb.final_dir / "model.safetensors"))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), preload
    assert rb.metadata["captured"] == f"{a},{b}"
    run_export(ExportConfig(checkpoint=str(rb.final_dir), out=tmp_path / "draft"))
    assert (tmp_path / "draft" / "config.json").is_file()

    c = write_captured(tmp_path / "c", samples[9:], {**manifest, "aux_layer_ids": [1, 2, 3]})
    with pytest.raises(
        ConfigError,
        match=r"c/manifest.json has aux_layer_ids=\[1, 2, 3\] but .*a/manifest.json has \[1, 2, "
        r"4\]",
    ):
        run_train(_cfg(tmp_path / "bad", tiny_llama, vocab, captured=f"{a},{c}"))
    with pytest.raises(ConfigError, match="empty entry"):
        run_train(_cfg(tmp_path / "bad2", tiny_llama, vocab, captured=f"{a},"))


def test_compile_cache_dir_holds_what_compiles_while_training(
    captured, tiny_llama, tmp_path, capfd
):
    """compile_cache = a directory: while training, torch.compile's inductor and Triton caches live
    in it (what a copy on a fresh GPU machine needs to skip the compile); the variables are restored
    afterwards."""
    import os

    from eagle3.train import run_train
    from eagle3.train.checkpoint import compile_cache_dir
    from eagle3.train.parallel import Dist

    samples, manifest, vocab = captured
    cache = tmp_path / "compile-cache"
    before = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    run_train(
        _cfg(
            tmp_path / "a",
            tiny_llama,
            vocab,
            max_steps=2,
            checkpoint={"eval_every": 1},
            runtime={"compile_cache": str(cache)},
        ),
        samples=samples,
        manifest=manifest,
    )
    assert (
        "compile cache: " in capfd.readouterr().err
        and (cache / "inductor").is_dir()
        and (cache / "triton").is_dir()
    )
    assert {k: os.environ.get(k) for k in before} == before  # restored
    # what compiles inside lands in the directory (the draft's graphs take ~30 s to compile on this
    # CPU: a small function stands in; the GPU round trip of the real ones is in
    # benchmarks/results/history/2026-12-01-compile-cache-round-trip.md)
    d = Dist(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    with compile_cache_dir(str(cache), d):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((cache / "inductor").resolve())
        torch.compile(lambda x: x * 3 - 1)(torch.ones(5))
    assert list((cache / "inductor").rglob("*.py")), (
        "no compiled code written into the cache directory"
    )
    assert {k: os.environ.get(k) for k in before} == before


def test_compile_cache_artifact_file_is_written_and_reloaded(captured, tiny_llama, tmp_path, capfd):
    """compile_cache = an existing FILE (the earlier format): the process's torch.compile artifacts
    are rewritten into it after the first validation and at the end, and a second run loads them; a
    broken file costs the compile time, not the run."""
    from eagle3.train import run_train

    samples, manifest, vocab = captured
    cache = tmp_path / "compile-cache.bin"
    cache.write_bytes(b"")  # an existing file selects the artifact format
    torch.compile(lambda x: x * 2 + 1)(
        torch.ones(3)
    )  # stands in for the draft's graphs (see above)
    kw = dict(max_steps=2, checkpoint={"eval_every": 1}, runtime={"compile_cache": str(cache)})
    run_train(_cfg(tmp_path / "a", tiny_llama, vocab, **kw), samples=samples, manifest=manifest)
    assert cache.stat().st_size > 0 and not list(tmp_path.glob(f".{cache.name}.*"))  # no temp left
    err = capfd.readouterr().err
    assert "written to" in err and "artifacts loaded" not in err
    run_train(_cfg(tmp_path / "b", tiny_llama, vocab, **kw), samples=samples, manifest=manifest)
    loaded = [
        line for line in capfd.readouterr().err.splitlines() if "artifacts loaded from" in line
    ]
    assert loaded and int(loaded[0].split("compile cache: ")[1].split()[0]) > 0
    cache.write_bytes(b"not a cache")
    run_train(_cfg(tmp_path / "c", tiny_llama, vocab, **kw), samples=samples, manifest=manifest)
    assert "not loaded" in capfd.readouterr().err


@pytest.mark.parametrize("extra_units,deepest_first", [(0, False), (32, False), (0, True)])
def test_layers_from_target_reproduce_the_target(tiny_llama, extra_units, deepest_first):
    """init_layers_from_target: a 3-layer draft over aux ids (1, 3) of the 5-layer target starts as
    the target's layers 3, 4 on its residual at id 3, so step 0 gives the target's own next-token
    logits (a wider MLP too; the deepest id need not come last)."""
    from transformers import AutoModelForCausalLM

    from eagle3.config import ConfigError
    from eagle3.train.target import load_top_layers
    from eagle3.train.trainer import build_draft
    from eagle3.weights import load_target_tensors, read_target_config

    target_cfg = read_target_config(tiny_llama)
    L, V, inter = (
        target_cfg["num_hidden_layers"],
        target_cfg["vocab_size"],
        target_cfg["intermediate_size"],
    )
    cfg = TrainConfig(
        target=str(tiny_llama),
        draft={
            "init_head_from_target": True,
            "init_layers_from_target": True,
            "num_hidden_layers": 3,
            "intermediate_size": inter + extra_units,
        },
    )
    tensors = {**load_target_tensors(tiny_llama), "layers": load_top_layers(tiny_llama, 3)}
    assert sorted(tensors["layers"]) == [L - 2, L - 1]
    aux_ids = [L - 2, 1] if deepest_first else [1, L - 2]
    draft = build_draft(
        cfg,
        target_cfg,
        tensors,
        torch.zeros(V, dtype=torch.long),
        torch.ones(V, dtype=torch.bool),
        num_aux=2,
        aux_layer_ids=aux_ids,
    ).eval()
    target = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    ids = torch.randint(6, V, (1, 40), generator=torch.Generator().manual_seed(0))  # (1, T)
    with torch.no_grad():
        r = target(input_ids=ids, output_hidden_states=True, use_cache=False)
        aux = torch.cat([r.hidden_states[k] for k in aux_ids], dim=-1)  # (1, T, 2*H)
        pos = torch.arange(ids.shape[1])[None]  # (1, T)
        attn = make_ttt_attention("naive", torch.zeros_like(ids), 1)
        out = draft(ids, aux, pos, attn, steps=1)[0]  # (1, T, H)
        torch.testing.assert_close(draft.logits(out), r.logits, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="num_hidden_layers >= 2"):
        TrainConfig(draft={"init_layers_from_target": True})
    with pytest.raises(ConfigError, match="it needs 2 .. 6"):
        load_top_layers(tiny_llama, 7)
    with pytest.raises(ConfigError, match="intermediate_size >= the target's"):
        build_draft(
            cfg.model_copy(
                update={
                    "draft": cfg.draft.model_copy(
                        update={"num_hidden_layers": 3, "intermediate_size": inter - 8}
                    )
                }
            ),
            target_cfg,
            tensors,
            torch.zeros(V, dtype=torch.long),
            torch.ones(V, dtype=torch.bool),
            num_aux=2,
            aux_layer_ids=[1, L - 2],
        )


def test_layers_from_target_refuse_non_llama_layers(tiny_qwen3):
    from eagle3.config import ConfigError
    from eagle3.train.target import load_top_layers

    with pytest.raises(ConfigError, match="not a dense Llama-style layer.*q_norm"):
        load_top_layers(tiny_qwen3, 2)


def test_supervise_all_trains_on_prompt_rows_and_validates_on_assistant_rows(
    captured, tiny_llama, tmp_path
):
    from eagle3.train import run_train

    samples, manifest, vocab = captured
    logs = {}
    for mode in ("assistant", "all"):
        run_train(
            _cfg(tmp_path / mode, tiny_llama, vocab, max_steps=2, loss={"supervise": mode}),
            samples=samples,
            manifest=manifest,
        )
        rows = [
            json.loads(x)
            for x in (tmp_path / mode / "logs" / "metrics.jsonl").read_text().splitlines()
        ]
        logs[mode] = {
            split: [r["num_rows"] for r in rows if r["split"] == split]
            for split in ("train", "val")
        }
    assert all(a < b for a, b in zip(logs["assistant"]["train"], logs["all"]["train"], strict=True))
    assert logs["assistant"]["val"] == logs["all"]["val"] and logs["all"]["val"][0] > 0


def test_weight_average_ramps_swaps_and_restores():
    from eagle3.train.average import WeightAverage

    p = torch.nn.Parameter(torch.zeros(3))
    ema = WeightAverage([p], decay=0.9)
    with torch.no_grad():
        p.fill_(10.0)
    ema.update(0)  # decay ramps: min(0.9, 1/10) = 0.1 -> 0.9 of the new weights
    torch.testing.assert_close(ema.shadow[0], torch.full((3,), 9.0))
    ema.update(100)  # decay 0.9 -> 0.9 * 9 + 0.1 * 10
    torch.testing.assert_close(ema.shadow[0], torch.full((3,), 9.1))
    with ema.applied():
        torch.testing.assert_close(p.detach(), torch.full((3,), 9.1))
    torch.testing.assert_close(p.detach(), torch.full((3,), 10.0))


def test_freeze_keeps_named_parameters_fixed(captured, tiny_llama, tmp_path):
    from safetensors.torch import load_file

    from eagle3.config import ConfigError
    from eagle3.train import run_train

    samples, manifest, vocab = captured
    cfg = _cfg(
        tmp_path,
        tiny_llama,
        vocab,
        draft={
            "num_hidden_layers": 2,
            "freeze": ["layers", "lm_head"],
            "init_head_from_target": True,
        },
    )
    run_train(cfg, samples=samples, manifest=manifest)
    first = load_file(str(tmp_path / "checkpoints" / "step-2" / "model.safetensors"))
    last = load_file(str(tmp_path / "final" / "model.safetensors"))
    frozen = [k for k in last if k.startswith(("layers.", "lm_head."))]
    assert frozen and all(torch.equal(first[k], last[k]) for k in frozen)
    assert not torch.equal(first["fc.weight"], last["fc.weight"])  # the rest trains
    with pytest.raises(ConfigError, match="'mid'.*midlayer"):
        run_train(
            _cfg(tmp_path / "bad", tiny_llama, vocab, draft={"freeze": "mid,fc"}),
            samples=samples,
            manifest=manifest,
        )
    assert TrainConfig(draft={"freeze": "layers, lm_head"}).draft.freeze == [
        "layers",
        "lm_head",
    ]  # the CLI's comma form


def test_midlayer_feature_loss_needs_the_copied_layers(captured, tiny_llama, tmp_path):
    from pydantic import ValidationError

    from eagle3.config import ConfigError
    from eagle3.train import run_train

    with pytest.raises(ValidationError, match="needs draft.init_layers_from_target"):
        TrainConfig(loss={"midlayer_feature_weight": 1.0})
    samples, manifest, vocab = (
        captured  # tiny target: 5 layers, aux ids (1, 2, 4); 2 draft layers copy layer 4
    )
    ok = dict(
        draft={"init_layers_from_target": True, "num_hidden_layers": 2},
        loss={"midlayer_feature_weight": 1.0},
        max_steps=1,
    )
    run_train(_cfg(tmp_path / "ok", tiny_llama, vocab, **ok), samples=samples, manifest=manifest)
    with pytest.raises(
        ConfigError, match="use aux id 3"
    ):  # 3 draft layers copy layers 3, 4: they read id 3
        three = deep_merge(ok, {"draft": {"num_hidden_layers": 3}})
        run_train(
            _cfg(tmp_path / "bad", tiny_llama, vocab, **three),
            samples=samples,
            manifest=manifest,
        )


@pytest.mark.slow
def test_split_compile_matches_eager_and_compiles_once():
    """compile_blocks("split"): the blocks around the attention kernel are compiled once for all TTT
    steps (3 graphs: midlayer pre, midlayer post, final norm, whatever K), and the compiled step's
    loss and grads under bf16 autocast match the eager step's (the draft's matrices cast once per
    unroll in both)."""
    from benchmarks.step_setup import build_benchmark
    from torch._dynamo.utils import counters

    from eagle3.model.draft import DraftConfig
    from eagle3.train.step import ttt_forward

    cfg = DraftConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        vocab_size=256,
        draft_vocab_size=64,
        target_hidden_size=32,
        num_aux=3,
    )

    def run(mode):
        torch._dynamo.reset()
        counters.clear()
        s = build_benchmark(
            cfg,
            batch_size=1,
            seq_len=32,
            steps=3,
            device="cpu",
            dtype=torch.float32,
            attention="sdpa",
            compile=mode is not None,
            compile_mode=mode or "layer",
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ttt_forward(s.model, s.batch, s.head, steps=3, attention="sdpa")
        out.loss.backward()
        return out.loss.item(), {
            n: p.grad for n, p in s.model.named_parameters() if p.grad is not None
        }

    l0, g0 = run(None)
    l1, g1 = run("split")
    assert counters["stats"]["unique_graphs"] == 3
    assert l1 == pytest.approx(l0, rel=1e-3) and set(g1) == set(g0)
    for n in g0:
        assert ((g1[n] - g0[n]).abs().max() / g0[n].abs().max()).item() < 3e-2, n
    with pytest.raises(ValueError, match="expected 'layer' or 'split'"):
        build_benchmark(
            cfg,
            seq_len=32,
            steps=1,
            device="cpu",
            dtype=torch.float32,
            compile=True,
            compile_mode="whole",
        )
