"""The draft-family seam: a family defined here (a trivial variant of EAGLE-3: a learned gate on
the first step's hidden), registered from this test, trains on a synthetic capture, is exported,
read back and served by its own vLLM method, with no library file knowing it; train, export,
the offline replay and evaluate take it from the registry by the name its checkpoint records."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from eagle3.config import EvaluateConfig, ExportConfig, TrainConfig
from eagle3.export import ExportError, run_export
from eagle3.model import family as registry
from eagle3.model.draft import DraftConfig, DraftConfigError, Eagle3Draft, draft_config_from_target


class GatedDraft(Eagle3Draft):
    """EAGLE-3 with one learned scalar on the combined aux states."""

    def __init__(self, cfg: DraftConfig):
        super().__init__(cfg)
        self.gate = torch.nn.Parameter(torch.ones(1))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        return self.gate * super().combine(aux)


class GatedFamily:
    """The family of GatedDraft (eagle3.model.family.DraftFamily)."""

    name = "test-gated"
    vllm_method = "eagle3-gated"
    export_formats = ("vllm",)

    def draft_config(
        self, target_cfg: dict[str, Any], num_aux: int, draft_vocab_size: int, options: Any
    ) -> DraftConfig:
        cfg = draft_config_from_target(target_cfg, num_aux, draft_vocab_size, options)
        return dataclasses.replace(cfg, family=self.name)

    def build(self, cfg: DraftConfig) -> GatedDraft:
        return GatedDraft(cfg)

    def export_config(
        self, cfg: DraftConfig, aux_layer_ids: list[int], fmt: str, verifier: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "architectures": ["GatedEagle3Draft"],
            "hidden_size": cfg.hidden_size,
            "aux_layer_ids": list(aux_layer_ids),
            "verifier": verifier["name_or_path"],
        }


@pytest.fixture
def gated(monkeypatch):
    """GatedFamily, registered for this test only."""
    monkeypatch.setattr(registry, "REGISTERED", dict(registry.REGISTERED))
    return registry.register_family(GatedFamily())


def test_a_family_defined_outside_the_library_trains_exports_and_serves(
    gated, tiny_llama, tmp_path
):
    from tests.synthetic_capture import capture_samples, frequent_ids, write_vocab

    from eagle3.evaluate import speculative_config
    from eagle3.train.estimate import load_draft_dir
    from eagle3.train.trainer import run_train

    assert "test-gated" in registry.family_names()
    samples, manifest = capture_samples(
        tiny_llama, num=12, aux_layer_ids=(1, 2, 4), min_len=16, max_len=32
    )
    vocab = write_vocab(tmp_path / "vocab", 512, frequent_ids(samples, 200, 512))
    cfg = TrainConfig(
        target=str(tiny_llama),
        captured="in-memory",
        vocab=str(vocab),
        out=tmp_path / "train",
        max_steps=6,
        device="cpu",
        draft={"family": "test-gated"},
        optimizer={"lr": 5e-3},
        schedule={"warmup_steps": 1},
        loader={"max_seq_len": 64, "val_fraction": 0.25},
        loss={"ttt_steps": 2},
        checkpoint={"eval_every": 3, "save_every": 3, "log_every": 1},
    )
    res = run_train(cfg, samples=samples, manifest=manifest)
    assert res.metadata["draft_config"]["family"] == "test-gated"
    trained = load_file(str(res.final_dir / "model.safetensors"))["gate"]
    assert trained.shape == (1,) and not torch.equal(trained, torch.ones(1))  # it trains

    draft_dir = tmp_path / "draft"
    run_export(ExportConfig(checkpoint=str(tmp_path / "train"), out=draft_dir))
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["architectures"] == ["GatedEagle3Draft"] and config["aux_layer_ids"] == [1, 2, 4]
    exported = load_file(str(draft_dir / "model.safetensors"))
    assert torch.equal(exported["gate"].float(), trained.bfloat16().float())
    with pytest.raises(ExportError, match=r"family test-gated exports vllm"):
        run_export(
            ExportConfig(
                checkpoint=str(tmp_path / "train"), out=tmp_path / "s", format="speculators"
            )
        )

    model, meta = load_draft_dir(res.final_dir, tiny_llama)  # the offline replay, refine
    assert isinstance(model, GatedDraft) and torch.equal(model.gate.data, trained)
    served = speculative_config(EvaluateConfig(draft=str(draft_dir), num_speculative_tokens=3))
    assert served == {
        "method": "eagle3-gated",
        "model": str(draft_dir),
        "num_speculative_tokens": 3,
    }


def test_an_unknown_family_is_named_with_the_known_ones(tiny_llama):
    from eagle3.train.trainer import build_draft
    from eagle3.weights import load_target_tensors, read_target_config

    cfg = TrainConfig(target=str(tiny_llama), draft={"family": "eagle4"})
    vocab = torch.zeros(64, dtype=torch.long), torch.ones(512, dtype=torch.bool)
    with pytest.raises(DraftConfigError, match=r"'eagle4' is not registered; known: eagle3, "):
        build_draft(cfg, read_target_config(tiny_llama), load_target_tensors(tiny_llama), *vocab, 3)
    with pytest.raises(DraftConfigError, match="taken"):
        registry.register_family(dataclasses.replace(registry.get_family("eagle3"), fc_norm=True))


def test_the_built_in_families_differ_only_in_their_switches(tiny_llama):
    from eagle3.weights import read_target_config

    target_cfg = read_target_config(tiny_llama)
    shapes = {
        name: registry.get_family(name).draft_config(target_cfg, 3, 64, None)
        for name in ("eagle3", "eagle3.1")
    }
    assert (shapes["eagle3"].fc_norm, shapes["eagle3"].norm_output) == (False, False)
    assert (shapes["eagle3.1"].fc_norm, shapes["eagle3.1"].norm_output) == (True, True)
    assert dataclasses.replace(shapes["eagle3.1"], family="eagle3", fc_norm=False) == (
        dataclasses.replace(shapes["eagle3"], norm_output=True)
    )
    assert {registry.get_family(n).vllm_method for n in shapes} == {"eagle3"}
