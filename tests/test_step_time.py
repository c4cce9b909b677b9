"""The step-time model (eagle3.step_time) term by term on hand-computed cases, the routing
measurement's reader and interpolation, and the speed-up prediction (eagle3.speedup)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from eagle3.hardware import ACHIEVED_MATMUL_SHARE, ACHIEVED_MEMORY_SHARE, HARDWARE, HardwareProfile
from eagle3.speedup import DOES_NOT_PAY, Acceptance, predict_speedups
from eagle3.step_time import (
    PASS_OVERHEAD_S,
    ROUTING_SCHEMA,
    UNIFORM_ROUTING,
    DraftWeights,
    MeasuredRouting,
    predict_draft_time_s,
    predict_pass_time_s,
    uniform_distinct_experts,
    weight_bytes,
)

ROOT = Path(__file__).resolve().parents[1]

#: a dense target small enough to count by hand
DENSE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "vocab_size": 100,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
#: 1 TB/s, 10 TFLOP/s, 1 GB/s links with 10 us all-reduces: round numbers for hand counts
TOY = HardwareProfile("toy", "hand-count machine", 2, 10.0, 1, 1.0, "toy link", 1.0, None, 10.0)

KIMI_INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "group_size": 32,
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ],
}


def kimi() -> dict:
    return json.loads((ROOT / "configs/targets/kimi-k2.5.json").read_text())


def tiny_moe(**over) -> dict:
    return {
        **DENSE,
        "n_routed_experts": 16,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        **over,
    }


# ------------------------------------------------------------------------------- bytes per weight


def test_bytes_per_param_from_the_quantization_config():
    cfg = kimi()
    cfg["text_config"]["quantization_config"] = KIMI_INT4
    b = weight_bytes(cfg)
    # INT4 in groups of 32 with one bf16 scale each: 4/8 + 2/32
    assert b["routed_experts"] == 0.5 + 2 / 32 == 0.5625
    # ignored: attention, shared experts, the dense MLP, lm_head; the router is never quantized
    assert b["attention"] == b["shared_experts"] == b["dense_mlp"] == b["lm_head"] == 2.0
    assert b["router"] == 2.0
    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    b8 = weight_bytes({**DENSE, "quantization_config": fp8})
    assert b8["attention"] == 1 + 4 / 128**2 and b8["lm_head"] == 2.0
    assert weight_bytes(DENSE)["attention"] == 2.0
    assert weight_bytes(DENSE, weight_bits=4)["dense_mlp"] == 0.5
    with pytest.raises(ValueError, match="quant_method = 'gptq'.*weight_bits="):
        weight_bytes({**DENSE, "quantization_config": {"quant_method": "gptq"}})


def test_the_kimi_preset_carries_its_int4_experts():
    b = weight_bytes(kimi())
    assert b["routed_experts"] == 0.5625 and b["attention"] == 2.0


# ------------------------------------------------------------------------------ distinct experts


def test_uniform_bound_equals_a_brute_force_count():
    E, k, n = 5, 2, 3
    subsets = list(itertools.combinations(range(E), k))
    counts = [len(set().union(*picks)) for picks in itertools.product(subsets, repeat=n)]
    assert uniform_distinct_experts(E, k, n) == pytest.approx(sum(counts) / len(counts))
    assert uniform_distinct_experts(384, 8, 1) == pytest.approx(8)
    assert uniform_distinct_experts(384, 8, 10_000) == pytest.approx(384)


def routing_table(E=16, k=2, ts=(1, 2, 4), bs=(1, 4), share=1.0) -> dict:
    """A routing.json whose entries wake `share` of the uniform bound's effective tokens."""
    mean = [[uniform_distinct_experts(E, k, share * t * b) if t * b > 1 else k for b in bs]
            for t in ts]  # fmt: skip
    return {
        "schema": ROUTING_SCHEMA,
        "num_experts": E,
        "top_k": k,
        "moe_layer_ids": [1],
        "num_rows": 8,
        "num_tokens": 512,
        "backend": "hf",
        "routing": "softmax_topk",
        "distinct_experts": {
            "t": list(ts),
            "b": list(bs),
            "mean": mean,
            "per_layer_mean": {"1": mean},
        },  # fmt: skip
    }


def test_routing_interpolation_reproduces_the_table_and_stays_below_num_experts(tmp_path):
    (tmp_path / "routing.json").write_text(json.dumps(routing_table(share=0.6)))
    r = MeasuredRouting.read(tmp_path)
    assert r.source == str(tmp_path / "routing.json") and r.num_tokens == 512
    for i, t in enumerate(r.t):
        for j, b in enumerate(r.b):
            assert r.distinct_experts(t, b) == pytest.approx(r.mean[i][j])
    # between points: between the neighbours; beyond the table: the edge's correlation, capped
    assert r.distinct_experts(2, 1) < r.distinct_experts(3, 1) < r.distinct_experts(4, 1)
    assert r.distinct_experts(4, 4) < r.distinct_experts(8, 4) < 16
    assert r.distinct_experts(1000, 64) == pytest.approx(16) and r.distinct_experts(1000, 64) <= 16
    # a cell the sample could not fill takes the nearest measured cell's correlation
    d = routing_table(share=0.6)
    d["distinct_experts"]["mean"][2][1] = None
    holed = MeasuredRouting.from_dict(d)
    assert holed.distinct_experts(4, 4) == pytest.approx(uniform_distinct_experts(16, 2, 0.6 * 16))
    # measured routing at the uniform bound gives the uniform bound anywhere
    u = MeasuredRouting.from_dict(routing_table(share=1.0))
    for t, b in [(3, 2), (7, 1), (2, 16), (6, 64)]:
        assert u.distinct_experts(t, b) == pytest.approx(uniform_distinct_experts(16, 2, t * b))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(schema="x"), "schema"),
        (lambda d: d["distinct_experts"]["mean"].pop(), r"distinct_experts\.mean: not 3 rows"),
        (lambda d: d["distinct_experts"]["mean"][2].__setitem__(1, 99.0), r"mean\[2\]\[1\]"),
        (lambda d: d["distinct_experts"].update(t=[2, 1, 4]), "increasing"),
        (lambda d: d.pop("num_experts"), "missing"),
    ],
)
def test_a_bad_routing_file_names_the_field(edit, match):
    d = routing_table()
    edit(d)
    with pytest.raises(ValueError, match=match):
        MeasuredRouting.from_dict(d, "runs/x/routing.json")


# ------------------------------------------------------------------------------------- the pass


def test_memory_flop_communication_and_overhead_terms_by_hand():
    p = predict_pass_time_s(DENSE, TOY, tp=1, t=1, b=1, context_len=9)
    # weights: attention 2 x (64*16*12 + 4*16*64) = 32,768 params, MLP 2 x 3*64*128 = 49,152,
    # lm_head 6,400, all bf16; the embedding reads one row; KV: 10 tokens x 2 layers x k,v x
    # 4 heads x 16 x 2 B
    weights = 2 * (32_768 + 49_152 + 6_400) + 64 * 2
    kv = 10 * 2 * 2 * 4 * 16 * 2
    assert sum(p.weight_bytes.values()) == weights and p.kv_bytes == kv
    assert p.memory_s == pytest.approx((weights + kv) / (1e12 * ACHIEVED_MEMORY_SHARE))
    # 2 FLOPs per weight + attention over 9 keys: 2 layers x 2 x 4 heads x 16
    flops = 2 * (32_768 + 49_152 + 6_400 + 2 * 128 * 9)
    assert p.flops == flops
    assert p.compute_s == pytest.approx(flops / (10e12 * ACHIEVED_MATMUL_SHARE))
    assert p.comm_s == 0 and p.overhead_s == PASS_OVERHEAD_S and p.bound == "memory"
    assert p.total_s == pytest.approx(p.memory_s + PASS_OVERHEAD_S)

    q = predict_pass_time_s(DENSE, TOY, tp=2, t=1, b=1, context_len=9, overhead_s=0.0)
    # 5 all-reduces (2 per layer + the embedding's) + 1 logits gather, 10 us each; ring bytes:
    # 5 x 2 (2-1)/2 x 128 B + (2-1)/2 x 200 B of logits over 1 GB/s
    assert q.allreduce_latency_s == pytest.approx(6 * 10e-6)
    assert q.allreduce_bandwidth_s == pytest.approx((5 * 128 + 100) / 1e9)
    assert q.total_s == pytest.approx(max(q.memory_s, q.compute_s) + q.comm_s)

    big = predict_pass_time_s(DENSE, TOY, tp=1, t=8, b=64, context_len=9)
    assert big.bound == "compute" and big.total_s == pytest.approx(big.compute_s + PASS_OVERHEAD_S)


def test_a_verification_pass_reads_the_experts_its_tokens_wake():
    cfg = tiny_moe()
    one = predict_pass_time_s(cfg, TOY, tp=1, t=1, b=1, context_len=0)
    four = predict_pass_time_s(cfg, TOY, tp=1, t=4, b=1, context_len=0)
    expert = 3 * 64 * 32
    assert one.routing_source == UNIFORM_ROUTING
    assert one.weight_bytes["routed_experts"] == pytest.approx(1 * 2 * expert * 2)
    assert four.weight_bytes["routed_experts"] == pytest.approx(
        uniform_distinct_experts(16, 2, 4) * expert * 2
    )
    # routed-expert reads at their own share of the bandwidth (an MoE kernel below a device copy)
    slow = predict_pass_time_s(cfg, TOY, 1, 4, 1, 0, expert_bandwidth_share=0.5)
    routed = four.weight_bytes["routed_experts"]
    assert slow.memory_s - four.memory_s == pytest.approx(
        routed / 0.5e12 - routed / (1e12 * ACHIEVED_MEMORY_SHARE)
    )
    measured = MeasuredRouting.from_dict(routing_table(share=0.5), "r.json")
    m4 = predict_pass_time_s(cfg, TOY, tp=1, t=4, b=1, context_len=0, routing=measured)
    assert m4.distinct_experts_per_layer == pytest.approx(measured.distinct_experts(4, 1))
    assert m4.weight_bytes["routed_experts"] < four.weight_bytes["routed_experts"]
    assert m4.routing_source == "measured (r.json)"
    with pytest.raises(ValueError, match="routing of 16 experts, top 2, but the target has 32"):
        predict_pass_time_s(tiny_moe(n_routed_experts=32), TOY, 1, 1, 1, 0, measured)


def test_kimi_on_the_pcie_machine_replicates_mla_down_projections_and_routers():
    cfg = kimi()
    p = predict_pass_time_s(cfg, "rtx-pro-6000", tp=8, t=1, b=1, context_len=0)
    # vLLM keeps q_a_proj, kv_a_proj_with_mqa and the router whole on every rank
    assert p.weight_bytes["replicated"] == (61 * 7168 * (1536 + 576) + 60 * 7168 * 384) * 2
    # 123 all-reduces + the logits gather at 42 us
    assert p.allreduce_latency_s == pytest.approx(124 * 42e-6)


def test_draft_steps_by_hand():
    d = DraftWeights(step_bytes=2e6, fc_bytes=1e6, num_layers=1, hidden_size=64,
                     draft_vocab_size=100, kv_bytes_per_token=0)  # fmt: skip
    bw = 1e12 * ACHIEVED_MEMORY_SHARE
    assert predict_draft_time_s(d, TOY, 1, 3, 1, 0) == pytest.approx((3 * 2e6 + 1e6) / bw)
    # tp 2: half the bytes; per step 2 all-reduces of 128 B + a gather of 200 B, 10 us each
    comm = 3 * (3 * 10e-6 + (2 * 2 * 0.5 * 128 + 0.5 * 200) / 1e9)
    assert predict_draft_time_s(d, TOY, 2, 3, 1, 0) == pytest.approx((3e6 + 0.5e6) / bw + comm)


# ------------------------------------------------------------------------------------ speed-up


def test_acceptance_from_vllm_counters_and_extrapolation():
    a = Acceptance.from_counts([80, 40], num_drafts=100, num_decode_passes=200)
    assert a.rates == [0.8, 0.4] and a.drafted_fraction == 0.5
    assert a.rate(3) == pytest.approx(0.4 * 0.5) and a.rate(4) == pytest.approx(0.4 * 0.25)
    assert a.tokens_per_step(2) == pytest.approx(1 + 0.5 * 1.2)
    assert "0.500 = r2/r1" in a.extrapolation
    assert Acceptance.from_counts([30], 100, 100).rate(2) == pytest.approx(0.09)


def test_speedup_and_recommended_k_by_hand():
    acc = Acceptance([0.9, 0.8, 0.7], 1.0)
    pred = predict_speedups(DENSE, TOY, 1, acc, None, 9, ks=(1, 2, 3), concurrencies=(1,))
    base = predict_pass_time_s(DENSE, TOY, 1, 1, 1, 9).total_s
    for r in pred.rows:
        t = predict_pass_time_s(DENSE, TOY, 1, r.k + 1, 1, 9).total_s
        tokens = 1 + sum([0.9, 0.8, 0.7][: r.k])
        assert r.speedup == pytest.approx(tokens * base / t)
    assert pred.recommended_k[1] == max(pred.rows, key=lambda r: r.speedup).k == 3
    assert pred.summary_line().endswith(f"(1: k 3 ×{pred.rows[2].speedup:.2f})")

    never = predict_speedups(tiny_moe(), TOY, 2, Acceptance([0.0], 1.0), None, 9,
                             concurrencies=(1, 4))  # fmt: skip
    assert never.recommended_k == {1: None, 4: None}
    assert DOES_NOT_PAY in never.summary_line() and DOES_NOT_PAY in never.format_markdown()


def test_every_profile_prices_a_pass():
    for name, hw in HARDWARE.items():
        if hw.bf16_tflops is None:
            with pytest.raises(ValueError, match="no GPU figures"):
                predict_pass_time_s(DENSE, name, 1, 1, 1, 0)
            continue
        assert "memory_tb_s" in hw.sources
        if hw.num_gpus > 1:
            assert "allreduce_latency_us" in hw.sources
            assert predict_pass_time_s(kimi(), name, 8, 4, 16, 1000).total_s > 0


def test_one_published_figure_as_per_position_rates_and_the_break_even():
    from eagle3.speedup import break_even_tau, geometric_rates

    assert geometric_rates(3, tau=1.875) == pytest.approx([0.5, 0.25, 0.125])
    assert geometric_rates(2, mean_rate=0.375) == pytest.approx([0.5, 0.25])
    with pytest.raises(ValueError, match="outside"):
        geometric_rates(2, tau=4.0)
    cfg = tiny_moe()
    tau = break_even_tau(cfg, TOY, 2, 3, 1, None, 9)
    acc = Acceptance(geometric_rates(3, tau=tau), 1.0)
    pred = predict_speedups(cfg, TOY, 2, acc, None, 9, ks=(3,), concurrencies=(1,))
    assert 1.0 < tau < 4.0 and pred.rows[0].speedup == pytest.approx(1.0, abs=1e-6)


def test_draft_weights_of_a_draft_not_exported_yet():
    from eagle3.step_time import draft_weights_from_dims

    m = dict(H=64, Ht=128, n_aux=3, nh=4, kvh=2, d=16, inter=256, V=1000, Vd=100, n_layers=1)
    w = draft_weights_from_dims(m)
    attn = 2 * 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64
    assert w.step_bytes == 2 * (attn + 3 * 64 * 256 + 100 * 64 + 4 * 64)
    assert w.fc_bytes == 2 * 3 * 128 * 64 and w.kv_bytes_per_token == 2 * 2 * 16 * 2


def test_capture_counts_feed_the_model():
    """capture's own counting (eagle3.capture.routing.distinct_experts) on expert ids where each
    token keeps its predecessor's experts with probability 0.7: routing.json as capture writes it
    reads back, the table's cells come out of the interpolation unchanged, and a verification pass
    reads fewer expert bytes than the uniform bound says."""
    import numpy as np

    from eagle3.capture.routing import distinct_experts

    rng = np.random.default_rng(0)
    E, k, L, rows, T = 16, 2, 2, 72, 24
    ids = []
    for _ in range(rows):
        row = np.zeros((T, L, k), dtype=np.int16)
        for i in range(T):
            for layer in range(L):
                keep = i > 0 and rng.random() < 0.7
                row[i, layer] = row[i - 1, layer] if keep else rng.choice(E, k, replace=False)
        ids.append(row)
    offsets = np.concatenate([[0], np.cumsum([T] * rows)])
    masks = [np.ones(T, dtype=bool)] * rows
    counted = distinct_experts(
        np.concatenate(ids), offsets, masks, [1, 2], num_draws=64, window_tokens=(1, 2, 4, 8)
    )
    d = {"t": counted.t, "b": counted.b, "mean": counted.mean}
    table = {**routing_table(), "distinct_experts": d}
    r = MeasuredRouting.from_dict(table, "routing.json")
    assert r.distinct_experts(4, 1) == pytest.approx(counted.mean[2][0])
    assert counted.mean[2][0] < uniform_distinct_experts(E, k, 4)
    cfg = tiny_moe(n_routed_experts=E, num_experts_per_tok=k)
    measured = predict_pass_time_s(cfg, TOY, 1, 4, 1, 0, r)
    uniform = predict_pass_time_s(cfg, TOY, 1, 4, 1, 0)
    assert measured.weight_bytes["routed_experts"] < uniform.weight_bytes["routed_experts"]
