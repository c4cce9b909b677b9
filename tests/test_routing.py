"""The routing measurement (eagle3.capture.routing, routing_pass): the distinct-expert count against
a brute-force count, the reference routers against transformers' own, the row sample's bound, and
the transformers backend end to end on the tiny MoE targets (DeepSeek-V3 with expert groups and the
score-correction bias; Qwen3-MoE): routing.json in the consumer's schema, recorded in the manifest,
its ids the model's own. The vLLM backend against these ids: tests/test_kimi_k25.py (DeepSeek-V3
routing in the user's architecture, default suite) and tests/test_moe_targets.py (both families,
EAGLE3_SLOW_TESTS)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3.artifacts import CaptureManifest, RoutingStats
from eagle3.capture import run_capture
from eagle3.capture.routing import (
    RouterSpec,
    count_distinct,
    distinct_experts,
    draw_windows,
    route_logits,
    router_spec,
    window_starts,
)
from eagle3.capture.routing_pass import sample_rows
from eagle3.capture.routing_reference import compare_routing, reference_routing
from eagle3.config import CaptureConfig, PrepareConfig
from eagle3.step_time import uniform_distinct_experts

ROOT = Path(__file__).resolve().parents[1]
#: the tiny MoE targets' routing: DeepSeek-V3 with 4 groups of 2 experts, 2 groups kept, a bias
ROUTED_SPECS = {
    "deepseek_v3": dict(
        num_layers=3,
        seed=4,
        num_experts=8,
        num_expert_groups=4,
        topk_groups=2,
        router_bias_std=0.2,
    ),
    "qwen3_moe": dict(num_layers=3, seed=5, num_experts=8),
}
#: below this gap between the k-th and the next score, two implementations may rightly disagree
TIE = 1e-5


# ------------------------------------------------------------------------------- the count alone
def brute_force(ids: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Distinct experts per draw and layer with Python sets: ids [M, L, K], tokens [D, n]."""
    return np.array(
        [
            [
                len({int(e) for tok in draw for e in ids[tok, layer]})
                for layer in range(ids.shape[1])
            ]
            for draw in tokens
        ]
    )


def random_rows(num_rows: int, seed: int, num_layers: int = 3, e: int = 16, k: int = 2):
    """Rows of random routing ([T, L, K], each token's K experts distinct) and loss masks with
    answer spans."""
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for _ in range(num_rows):
        t = int(rng.integers(3, 40))
        ids.append(
            np.stack(
                [[rng.choice(e, k, replace=False) for _ in range(num_layers)] for _ in range(t)]
            )
        )
        mask = np.zeros(t, bool)
        a = int(rng.integers(0, t // 2))
        mask[a : a + int(rng.integers(1, t - a + 1))] = True
        masks.append(mask)
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in ids])])
    return np.concatenate(ids).astype(np.int16), offsets, masks


def test_hand_counted_case():
    # one row, one layer, top-2: tokens route to {0,1}, {1,2}, {2,3}
    ids = np.array([[[0, 1]], [[1, 2]], [[2, 3]]], dtype=np.int16)  # [3, 1, 2]
    got = distinct_experts(ids, np.array([0, 3]), [np.ones(3, bool)], [5], num_sequences=(1, 2))
    assert got.mean[:3] == [[2.0, None], [3.0, None], [4.0, None]]
    assert got.per_layer_mean["5"][1] == [3.0, None]
    assert got.num_draws[:3] == [[3, 0], [2, 0], [1, 0]]  # b = 1: every window
    assert got.mean[3:] == [[None, None]] * 5  # no window of 4 tokens in a 3-token row
    assert (
        "t=1,b=2" in got.null_reasons and "1 of the 1 sampled rows" in got.null_reasons["t=1,b=2"]
    )


def test_count_matches_brute_force_on_the_same_draws():
    ids, offsets, masks = random_rows(20, seed=1)
    rng = np.random.default_rng(7)
    for t, b in [(1, 1), (3, 1), (2, 4), (8, 4), (5, 16)]:
        drawn = draw_windows(offsets, masks, t, b, 50, rng)
        if drawn.tokens is None:
            continue
        # tiny blocks: the blocked path is exercised too
        assert np.array_equal(
            count_distinct(ids, drawn.tokens, block_elems=64), brute_force(ids, drawn.tokens)
        )
        # every drawn window lies in one row's answer tokens, b windows in b different rows
        for draw in drawn.tokens.reshape(-1, b, t):
            rows = [int(np.searchsorted(offsets, w[0], side="right")) - 1 for w in draw]
            assert len(set(rows)) == b
            for r, w in zip(rows, draw, strict=True):
                assert offsets[r] <= w[0] and w[-1] < offsets[r + 1]
                assert masks[r][w - offsets[r]].all()


def test_table_is_the_brute_force_mean_of_its_draws():
    """distinct_experts replayed draw by draw (same seed, same order of cells) with the brute-force
    count: every cell's mean and per-layer mean agree."""
    ids, offsets, masks = random_rows(24, seed=2)
    got = distinct_experts(ids, offsets, masks, [1, 4, 7], num_draws=40, seed=3)
    rng = np.random.default_rng(3)
    for i, t in enumerate(got.t):
        for j, b in enumerate(got.b):
            drawn = draw_windows(offsets, masks, t, b, 40, rng)
            if drawn.tokens is None:
                assert got.mean[i][j] is None and f"t={t},b={b}" in got.null_reasons
                continue
            counts = brute_force(ids, drawn.tokens)
            assert got.mean[i][j] == pytest.approx(counts.mean(), abs=1e-4)
            assert got.per_layer_mean["4"][i][j] == pytest.approx(counts[:, 1].mean(), abs=1e-4)
    assert got.mean[0][0] == 2.0  # one token: its top-k
    assert got.mean[0][3] is None  # 64 sequences from 24 rows


def test_b1_takes_every_window_when_there_are_few():
    ids, offsets, masks = random_rows(3, seed=4)
    windows = sum(len(window_starts(m, 2)) for m in masks)
    drawn = draw_windows(offsets, masks, 2, 1, 10_000, np.random.default_rng(0))
    assert drawn.tokens.shape == (windows, 2)
    assert len({tuple(w) for w in drawn.tokens}) == windows


def test_window_starts_keep_to_the_answer():
    mask = np.array([0, 1, 1, 1, 0, 1, 1], bool)
    assert window_starts(mask, 1).tolist() == [1, 2, 3, 5, 6]
    assert window_starts(mask, 2).tolist() == [1, 2, 5]
    assert window_starts(mask, 3).tolist() == [1]
    assert window_starts(mask, 8).tolist() == []


def test_uniform_bound():
    assert uniform_distinct_experts(384, 8, 1) == pytest.approx(8)
    assert uniform_distinct_experts(8, 2, 1000) == pytest.approx(8)
    assert uniform_distinct_experts(384, 8, 4) < 32  # tokens that pick the same expert


def test_row_sample_is_bounded_seeded_and_skips_what_capture_skips():
    lengths = np.array([0, 5, 9, 700, 12, 3] * 30)
    rows = sample_rows(lengths, 512, 64)
    assert len(rows) == 64 and len(set(rows.tolist())) == 64
    assert np.array_equal(rows, sample_rows(lengths, 512, 64))  # the seed
    assert (lengths[rows] > 0).all() and (lengths[rows] < 512).all()
    assert sample_rows(lengths[:6], 512, 64).tolist() == [1, 2, 4, 5]  # fewer rows than asked


# ------------------------------------------------------------------------- the reference routers
def test_grouped_topk_bias_is_deepseek_v3s_router():
    """The reference (written from the definition) gives transformers' DeepseekV3TopkRouter's
    experts; the groups and the bias each change some tokens' experts, so both are exercised."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=4, topk_group=2
    )
    torch.manual_seed(0)
    router = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(router.weight, std=0.3)
    router.e_score_correction_bias.normal_(std=0.2)
    x = torch.randn(500, 32)
    logits, _, want = router(x)
    spec = RouterSpec("grouped_topk_bias", 16, 3, 4, 2)
    got = route_logits(logits, spec, router.e_score_correction_bias)
    assert torch.equal(got, want.sort(-1).values)
    no_groups = route_logits(
        logits, RouterSpec("grouped_topk_bias", 16, 3, 1, 1), router.e_score_correction_bias
    )
    no_bias = route_logits(logits, spec)
    assert (no_groups != got).any(-1).sum() > 50 and (no_bias != got).any(-1).sum() > 50


def test_softmax_topk_is_qwen3_moes_router():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    router = Qwen3MoeTopKRouter(
        Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4)
    )
    torch.nn.init.normal_(router.weight, std=0.3)
    logits, _, want = router(torch.randn(500, 32))
    assert torch.equal(
        route_logits(logits, RouterSpec("softmax_topk", 16, 4)), want.sort(-1).values
    )


def test_router_spec_of_the_presets():
    def read(name: str) -> dict:
        return json.loads((ROOT / "configs/targets" / f"{name}.json").read_text())

    kimi = router_spec(read("kimi-k2.5"))
    assert (kimi.kind, kimi.num_experts, kimi.top_k) == ("grouped_topk_bias", 384, 8)
    qwen = router_spec(read("qwen3-30b-a3b"))
    assert (qwen.kind, qwen.num_experts, qwen.top_k) == ("softmax_topk", 128, 8)
    assert router_spec(read("llama-3.1-8b")) is None
    with pytest.raises(ValueError, match="mixtral.*routing_sample_rows: 0"):
        router_spec({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2})


# ------------------------------------------------------------- the transformers backend, end to end
def build_routed(arch: str, root: Path) -> tuple[Path, Path]:
    """(target, prepared): a tiny MoE target of ROUTED_SPECS and run_prepare on tiny chats (answer
    spans: windows of up to 8 tokens)."""
    from eagle3.data.prepare import run_prepare
    from eagle3.testing.tiny import TinySpec, build_tiny_target, tiny_conversations

    target = build_tiny_target(root / "target", TinySpec(arch=arch, **ROUTED_SPECS[arch]))
    chats = root / "chats.jsonl"
    chats.write_text(
        "".join(json.dumps(c) + "\n" for c in tiny_conversations(10, seed=3, max_turns=3))
    )
    prepared = run_prepare(
        PrepareConfig(target=str(target), data=str(chats), out=root / "prepared", max_seq_len=256)
    )
    return target, prepared.out


@pytest.mark.parametrize("arch", sorted(ROUTED_SPECS))
def test_hf_capture_records_the_models_routing(arch, tmp_path):
    target, prepared = build_routed(arch, tmp_path)
    res = run_capture(
        CaptureConfig(
            target=str(target),
            data=str(prepared),
            out=tmp_path / "cap",
            backend="hf",
            dtype="float32",
            aux_layer_ids=[1, 2],
            batch_tokens=256,
            routing_sample_rows=6,
        )
    )
    stats = RoutingStats.load(res.out)
    raw = json.loads((res.out / "routing.json").read_text())
    assert raw["schema"] == "eagle3.routing/1" and raw["backend"] == "hf"
    assert raw["routing"] == {"deepseek_v3": "grouped_topk_bias", "qwen3_moe": "softmax_topk"}[arch]
    assert (stats.num_experts, stats.top_k) == (8, 2)
    # DeepSeek-V3: layer 0 dense (first_k_dense_replace 1)
    assert stats.moe_layer_ids == ({"deepseek_v3": [1, 2], "qwen3_moe": [0, 1, 2]}[arch])
    d = raw["distinct_experts"]
    assert d["t"] == list(range(1, 9)) and d["b"] == [1, 4, 16, 64]
    assert len(d["mean"]) == 8 and all(len(row) == 4 for row in d["mean"])
    assert set(d["per_layer_mean"]) == {str(x) for x in stats.moe_layer_ids}
    assert stats.cell(1, 1) == 2.0  # one token wakes its top-k
    assert stats.cell(8, 1) > stats.cell(2, 1) > 2.0 and stats.cell(4, 4) <= 8
    assert stats.cell(1, 16) is None and "t=1,b=16" in raw["null_reasons"]  # 6 rows, not 16
    m = CaptureManifest.load(res.out)
    assert m.routing["file"] == "routing.json" and m.routing["num_rows"] == 6

    # the row sample's bound, and the ids are the model's own routing (and the reference's)
    npz = np.load(res.out / "routing_ids.npz")
    assert stats.num_rows == len(npz["rows"]) == 6 and len(npz["offsets"]) == 7
    assert stats.num_tokens == npz["ids"].shape[0] == npz["offsets"][-1]
    from eagle3.hf import load_causal_lm
    from eagle3.prepared import load_prepared

    ds = load_prepared(prepared)
    samples = [np.asarray(ds[int(r)]["input_ids"]) for r in npz["rows"]]
    got = [npz["ids"][a:b] for a, b in zip(npz["offsets"][:-1], npz["offsets"][1:], strict=True)]
    own, ref, margins = reference_routing(load_causal_lm(target, dtype=torch.float32), samples)
    # transformers' router == the reference written from the definition
    assert all(torch.equal(o, r) for o, r in zip(own, ref, strict=True))
    seen = compare_routing(got, own, margins, TIE)
    assert seen == {
        "differ": 0,
        "near_ties": 0,
        "token_layers": stats.num_tokens * len(stats.moe_layer_ids),
    }

    # a rerun keeps the measurement; routing_sample_rows 0 measures nothing
    before = (res.out / "routing.json").stat().st_mtime_ns
    run_capture(CaptureConfig(**{**res_config(res, target, prepared), "routing_sample_rows": 6}))
    assert (res.out / "routing.json").stat().st_mtime_ns == before
    off = run_capture(
        CaptureConfig(
            **{
                **res_config(res, target, prepared),
                "out": tmp_path / "off",
                "routing_sample_rows": 0,
            }
        )
    )
    assert not (off.out / "routing.json").exists() and CaptureManifest.load(off.out).routing is None


def res_config(res, target: Path, prepared: Path) -> dict:
    return dict(
        target=str(target),
        data=str(prepared),
        out=res.out,
        backend="hf",
        dtype="float32",
        aux_layer_ids=[1, 2],
        batch_tokens=256,
    )


def test_dense_target_measures_nothing(tiny_llama, tmp_path):
    from test_capture import make_prepared

    res = run_capture(
        CaptureConfig(
            target=str(tiny_llama),
            data=str(make_prepared(tiny_llama, tmp_path / "p", num=3)),
            out=tmp_path / "cap",
            backend="hf",
            dtype="float32",
        )
    )
    assert RoutingStats.load(res.out) is None and CaptureManifest.load(res.out).routing is None


def test_an_moe_router_it_does_not_know_is_said_and_skipped(tmp_path, capsys):
    """A Mixtral-like target: the capture goes on without routing.json, saying why."""
    from eagle3.capture.routing_pass import wanted_spec

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2})
    )
    assert wanted_spec(CaptureConfig(target=str(tmp_path))) is None
    assert "'mixtral'" in capsys.readouterr().err
    assert wanted_spec(CaptureConfig(target=str(tmp_path), routing_sample_rows=0)) is None
