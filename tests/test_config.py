from pathlib import Path

import pytest

from eagle3.cli import build_parser, stage_config_from_args
from eagle3.config import (
    CaptureConfig,
    ConfigError,
    PipelineConfig,
    TrainConfig,
    load_pipeline_config,
)
from eagle3.stages import build_stage_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_file_validates(path):
    cfg = load_pipeline_config(path).resolved()
    for stage in ("prepare", "capture", "vocab", "train", "export"):
        assert getattr(cfg, stage).out is not None


def test_unknown_key_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("target: t\ndata: d\ntrain:\n  lr: 1e-3\n  learning_rate: 3\n")
    with pytest.raises(ConfigError, match=r"train\.learning_rate: unknown key"):
        load_pipeline_config(p)


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError, match=r"ttt_steps = 0: Input should be greater than 0"):
        build_stage_config("train", {"ttt_steps": 0})


def test_layers_parse_and_validate():
    assert CaptureConfig(layers="2,4,5").layers == [2, 4, 5]
    with pytest.raises(ValueError, match="duplicates"):
        CaptureConfig(layers=[2, 2])
    with pytest.raises(ValueError, match="comma-separated"):
        CaptureConfig(layers="2,x")


def test_require_names_the_flag():
    with pytest.raises(ConfigError, match="--captured"):
        TrainConfig(target="t").require("target", "captured")
    TrainConfig(target="t", captured="c").require("target", "captured")


def test_every_cli_flag_maps_to_a_field():
    args = build_parser().parse_args(
        ["train", "--target", "T", "--captured", "C", "--vocab", "V", "--out", "O", "--ttt-steps", "3",
         "--lr", "0.001", "--no-resume", "--draft-intermediate-size", "512"]
    )
    cfg = stage_config_from_args("train", args)
    assert (cfg.ttt_steps, cfg.lr, cfg.resume, cfg.draft.intermediate_size) == (3, 1e-3, False, 512)
    assert cfg.out == Path("O")


def test_pipeline_resolution_fills_paths():
    cfg = PipelineConfig(target="T", data="D.jsonl", work_dir=Path("w")).resolved()
    assert cfg.regenerate.data == "D.jsonl"
    assert cfg.prepare.data == str(Path("w/regenerated/conversations.jsonl"))
    assert cfg.capture.data == str(Path("w/prepared"))
    assert cfg.train.captured == str(Path("w/captured"))
    cfg2 = PipelineConfig(target="T", data="D.jsonl", regenerate={"enabled": False}).resolved()
    assert cfg2.prepare.data == "D.jsonl"
