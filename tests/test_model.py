"""Draft model + TTT attention: kernels agree with the naive full-mask reference (values and
gradients)."""

from __future__ import annotations

import pytest
import torch

from eagle3.config.train_options import DraftOptions
from eagle3.model.draft import DraftConfig, DraftConfigError, Eagle3Draft, draft_config_from_target
from eagle3.train.attention import (
    causal_doc_mask,
    flex_split_attention,
    flex_ttt_attention,
    make_ttt_attention,
    merge_diagonal,
    naive_ttt_attention,
)

TARGET_CFG = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "vocab_size": 300,
    "num_hidden_layers": 6,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    },
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def small_cfg(**kw) -> DraftConfig:
    return draft_config_from_target(
        TARGET_CFG, num_aux=3, draft_vocab_size=100, overrides=DraftOptions(**kw)
    )


def docs(B: int, T: int) -> torch.Tensor:
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[0, 9:] = 1  # two documents in row 0
    if B > 1:
        doc[1, 5:14] = 1
        doc[1, 14:] = -1  # padding tail
    return doc


def qkv(B, T, steps, nh=4, kvh=2, d=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, nh, T, d, generator=g, dtype=dtype, requires_grad=True)
    ks = [
        torch.randn(B, kvh, T, d, generator=g, dtype=dtype, requires_grad=True)
        for _ in range(steps)
    ]
    vs = [
        torch.randn(B, kvh, T, d, generator=g, dtype=dtype, requires_grad=True)
        for _ in range(steps)
    ]
    return q, ks, vs


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_sdpa_matches_naive_values_and_grads(steps):
    B, T = 2, 20
    doc = docs(B, T)
    q, ks, vs = qkv(B, T, steps)
    ref = naive_ttt_attention(q, ks, vs, doc)
    got = make_ttt_attention("sdpa", doc, steps)(q, ks, vs)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(ref)
    g_ref = torch.autograd.grad((ref * w).sum(), [q, *ks, *vs])
    g_got = torch.autograd.grad((got * w).sum(), [q, *ks, *vs])
    for a, b in zip(g_got, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_naive_mask_is_the_eagle3_pattern():
    """Brute force: row t at step j sees step-0 keys s<=t of its document and only row t of steps
    1..j."""
    B, T, steps = 1, 6, 3
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])
    d = 4
    q = torch.zeros(B, 1, T, d)  # uniform attention over the allowed keys
    ks = [torch.zeros(B, 1, T, d) for _ in range(steps)]
    vs = [torch.zeros(B, 1, T, d) for _ in range(steps)]
    for s in range(
        steps
    ):  # value encodes (step, row) one-hot in a big vector -> use scalar ids instead
        vs[s][..., 0] = torch.arange(T).float() + 100 * s
    out = naive_ttt_attention(q, ks, vs, doc)[0, 0, :, 0]
    for t in range(T):
        allowed = [u for u in range(T) if u <= t and doc[0, u] == doc[0, t]] + [
            t + 100 * s for s in range(1, steps)
        ]
        assert out[t].item() == pytest.approx(sum(allowed) / len(allowed))


@pytest.mark.parametrize(
    "steps,T,padded",
    [
        (1, 32, None),
        (3, 32, None),
        (3, 40, None),
        (3, 40, False),
        pytest.param(4, 48, True, marks=pytest.mark.slow),
    ],
)
def test_flex_matches_naive_forward(steps, T, padded):
    """flex_attention runs forward-only on CPU (eager); gradients are checked on CUDA below. padded
    None (the default): the step-0 keys through flex plus the merged diagonal
    (flex_split_attention); False: the (j+1)T concatenated keys; True: every step's keys zero-padded
    to K*T with block lists cut per step (one compiled kernel for all steps; T=48 is a multiple of
    the block size, 16 here)."""
    B = 2
    doc = docs(B, T)
    q, ks, vs = qkv(B, T, steps, dtype=torch.float32)
    q, ks, vs = q.detach(), [k.detach() for k in ks], [v.detach() for v in vs]
    with torch.no_grad():
        ref = naive_ttt_attention(q, ks, vs, doc)
        # padded needs the compiled kernel (it skips the cut blocks; eager flex does not):
        # inductor's CPU flex
        fn = make_ttt_attention("flex", doc, steps, compiled=bool(padded), padded=padded)
        want_fn = flex_split_attention if padded is None else flex_ttt_attention
        assert fn.func is want_fn and fn.keywords.get("padded", None) is (
            None if padded is None else bool(padded)
        )
        # every step: the TTT loop calls it with the keys so far (step j sees j+1 of them)
        got = fn(q, ks, vs)
        for j in range(steps - 1):
            part = fn(q, ks[: j + 1], vs[: j + 1])
            want = naive_ttt_attention(q, ks[: j + 1], vs[: j + 1], doc)
            ok = (doc >= 0)[:, None, :, None].expand_as(want)
            torch.testing.assert_close(part[ok], want[ok], rtol=1e-4, atol=1e-4)
    valid = (doc >= 0)[:, None, :, None].expand_as(
        ref
    )  # fully-masked padding rows are kernel-defined
    torch.testing.assert_close(got[valid], ref[valid], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("steps", [2, 4])
def test_merge_diagonal_values_and_grads(steps):
    """flex_split_attention's arithmetic on the CPU (flex has no CPU backward): the causal block's
    output and log-sum-exp, merged with the diagonal keys, give the naive kernel's values and
    gradients (float64), the gradient through the log-sum-exp included."""
    B, T, nh, kvh, d = 2, 20, 4, 2, 8
    doc = docs(B, T)
    q, ks, vs = qkv(B, T, steps, nh=nh, kvh=kvh, d=d)
    s = (q @ ks[0].repeat_interleave(nh // kvh, 1).transpose(-1, -2)) * d**-0.5  # (B, nh, T, T)
    s = s.masked_fill(~causal_doc_mask(doc), float("-inf"))
    o0 = s.softmax(-1) @ vs[0].repeat_interleave(nh // kvh, 1)  # (B, nh, T, d)
    got = merge_diagonal(o0, s.logsumexp(-1), q, ks[1:], vs[1:])
    ref = naive_ttt_attention(q, ks, vs, doc)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad((got * w).sum(), [q, *ks, *vs]),
        torch.autograd.grad((ref * w).sum(), [q, *ks, *vs]),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex backward needs CUDA")
def test_flex_grads_cuda():
    B, T, steps = 2, 256, 3
    doc = docs(B, T).cuda()
    q, ks, vs = qkv(B, T, steps, d=16, dtype=torch.float32)
    leaves = [t.detach().cuda().requires_grad_() for t in [q, *ks, *vs]]
    q, ks, vs = leaves[0], leaves[1 : 1 + steps], leaves[1 + steps :]
    ref = naive_ttt_attention(q, ks, vs, doc)
    got = make_ttt_attention("flex", doc, steps)(q, ks, vs)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)
    w = torch.randn_like(ref)
    for a, b in zip(
        torch.autograd.grad((got * w).sum(), leaves),
        torch.autograd.grad((ref * w).sum(), leaves),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3)


def test_draft_config_from_target_and_overrides():
    cfg = small_cfg()
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        64,
        4,
        2,
        16,
    )
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert (
        cfg.max_position_embeddings == 1024
        and cfg.vocab_size == 300
        and cfg.draft_vocab_size == 100
    )
    over = small_cfg(
        intermediate_size=32, num_key_value_heads=1, max_position_embeddings=4096, rope_theta=1e4
    )
    assert (over.intermediate_size, over.num_key_value_heads, over.max_position_embeddings) == (
        32,
        1,
        4096,
    )
    nested = draft_config_from_target({"text_config": TARGET_CFG, "architectures": ["X"]}, 3, 100)
    assert nested.hidden_size == 64
    with pytest.raises(DraftConfigError, match="max_position_embeddings=512"):
        small_cfg(max_position_embeddings=512)
    with pytest.raises(DraftConfigError, match="hidden_size=32"):
        small_cfg(hidden_size=32)
    with pytest.raises(DraftConfigError, match="num_key_value_heads=3"):
        small_cfg(num_key_value_heads=3)
    assert small_cfg().num_hidden_layers == 1  # the draft's own depth, not the target's 6
    assert small_cfg(num_hidden_layers=2).num_hidden_layers == 2


def test_multi_layer_draft_ttt_kernels_agree_and_layers_matter():
    """A 3-layer draft: the exact CPU kernel (sdpa) == the naive full-mask reference through K
    steps, values and grads (each layer keeps its own per-step keys); the extra layers change the
    output (they are wired in)."""
    from eagle3.train.attention import make_ttt_attention

    torch.manual_seed(0)
    model = Eagle3Draft(small_cfg(num_hidden_layers=3)).double()
    B, T, K = 2, 20, 3
    doc = docs(B, T)
    ids = [torch.randint(0, 300, (B, T)) for _ in range(K)]
    aux = torch.randn(B, T, 3 * 64, dtype=torch.float64)
    pos = torch.arange(T).expand(B, T)

    def run(kind):
        model.zero_grad(set_to_none=True)
        outs = model(ids, aux, pos, make_ttt_attention(kind, doc, K), steps=K)
        w = torch.linspace(-1, 1, outs[0].numel(), dtype=torch.float64).view_as(outs[0])
        sum((o * w).sum() * (j + 1) for j, o in enumerate(outs)).backward()
        return torch.stack(outs), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    ref_out, ref_g = run("naive")
    out, g = run("sdpa")
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    assert set(g) == set(ref_g) and any(n.startswith("layers.2.") for n in g)
    for n in ref_g:
        torch.testing.assert_close(g[n], ref_g[n], rtol=1e-8, atol=1e-10)
    with torch.no_grad():
        model.layers["2"].mlp.down_proj.weight.zero_()
        model.layers["2"].self_attn.o_proj.weight.zero_()
        changed = torch.stack(model(ids, aux, pos, make_ttt_attention("sdpa", doc, K), steps=K))
    assert not torch.allclose(changed, ref_out)


def test_draft_step0_is_a_causal_document_aware_layer():
    """Step 0 with the TTT kernel == the same layer with plain causal SDPA per document; docs don't
    leak."""
    torch.manual_seed(0)
    cfg = small_cfg()
    model = Eagle3Draft(cfg).double()
    B, T = 1, 16
    ids = torch.randint(0, cfg.vocab_size, (B, T))
    aux = torch.randn(B, T, 3 * 64, dtype=torch.float64)
    doc = torch.tensor([[0] * 10 + [1] * 6])
    pos = torch.tensor([list(range(10)) + list(range(6))])
    out = model(ids, aux, pos, make_ttt_attention("sdpa", doc, 1))[0]

    def plain(q, ks, vs):
        k, v = ks[0].repeat_interleave(2, 1), vs[0].repeat_interleave(2, 1)
        return torch.cat(
            [
                torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True
                )
                for a, b in ((0, 10), (10, 16))
            ],
            2,
        )

    torch.testing.assert_close(out, model(ids, aux, pos, plain)[0])
    # second document alone, positions restarted: identical outputs
    alone = model(
        ids[:, 10:], aux[:, 10:], pos[:, 10:], make_ttt_attention("sdpa", doc[:, 10:], 1)
    )[0]
    torch.testing.assert_close(out[:, 10:], alone)


@pytest.mark.parametrize("layers", [1, 3])
def test_export_keys_cover_the_state_dict(layers):
    from tests.vllm_layout import expected_export_shapes

    model = Eagle3Draft(small_cfg(num_hidden_layers=layers))
    sd = model.export_state_dict()
    shapes = expected_export_shapes(model.cfg)
    assert set(sd) == set(shapes)
    assert {k.split(".")[1] for k in sd if k.startswith("layers.")} == {
        str(k) for k in range(1, layers)
    }
    assert all(shapes[f"layers.{k}.self_attn.q_proj.weight"] == (64, 64) for k in range(1, layers))
    assert all(tuple(sd[k].shape) == s for k, s in shapes.items())
    assert not model.embed_tokens.weight.requires_grad


def test_dropout_only_in_training():
    torch.manual_seed(0)
    cfg = DraftConfig(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        vocab_size=50,
        draft_vocab_size=20,
        target_hidden_size=32,
        num_aux=2,
        num_hidden_layers=2,
        dropout=0.3,
    )
    model = Eagle3Draft(cfg)
    plain = Eagle3Draft(DraftConfig(**{**cfg.to_dict(), "dropout": 0.0}))
    plain.load_state_dict(model.state_dict())
    ids, aux, pos = torch.randint(0, 50, (1, 6)), torch.randn(1, 6, 64), torch.arange(6)[None]
    attn = make_ttt_attention("naive", torch.zeros(1, 6, dtype=torch.long), 2)
    model.eval(), plain.eval()
    same = [
        torch.equal(a, b)
        for a, b in zip(model(ids, aux, pos, attn, 2), plain(ids, aux, pos, attn, 2), strict=True)
    ]
    assert all(same)
    model.train()
    assert not torch.allclose(model(ids, aux, pos, attn, 2)[0], plain(ids, aux, pos, attn, 2)[0])
