from pathlib import Path

import pytest

from eagle3.cli import build_parser, stage_config_from_args
from eagle3.config import (
    AuxLayerIds,
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
    p.write_text("target: t\ndata: d\ntrain:\n  optimizer:\n    lr: 1e-3\n  learning_rate: 3\n")
    with pytest.raises(ConfigError, match=r"train\.learning_rate: unknown key"):
        load_pipeline_config(p)


def test_bad_value_names_field_and_value():
    with pytest.raises(ConfigError, match=r"loss.ttt_steps = 0: Input should be greater than 0"):
        build_stage_config("train", {"loss": {"ttt_steps": 0}})


def test_layers_parse_and_validate():
    assert CaptureConfig(aux_layer_ids="2,4,5").aux_layer_ids == [2, 4, 5]
    with pytest.raises(ValueError, match="duplicates"):
        CaptureConfig(aux_layer_ids=[2, 2])
    with pytest.raises(ValueError, match="comma-separated"):
        CaptureConfig(aux_layer_ids="2,x")


#: (ids given, L, last_ok) -> the resolved ids, or the error's text
AUX_LAYER_ID_CASES = [
    (None, 32, False, [2, 16, 29]),  # the default (2, L//2, L-3)
    (None, 6, False, [1, 3, 4]),  # (2, 3, 3) collides: (1, L//2, L-2)
    (None, 4, False, r"the default \(2, L//2, L-3\) is not usable for a target with L=4 layers"),
    ([1, 2, 31], 32, False, [1, 2, 31]),
    (
        [1, 2, 32],
        32,
        False,
        r"= \[1, 2, 32\]: id\(s\) \[32\] out of range for this 32-layer target; use ids in 1\.\.31",
    ),
    # training may read the last layer (id L) from last_hidden_states
    ([1, 2, 32], 32, True, [1, 2, 32]),
    ([1, 33], 32, True, r"id\(s\) \[33\] out of range for this 32-layer target; use ids in 1..32"),
    ([0, 1], 8, False, r"id\(s\) \[0\] out of range"),  # id 0 would be the embeddings
    ([3, 3], 8, False, r"= \[3, 3\]: name each aux layer id once"),
]


@pytest.mark.parametrize("ids,num_layers,last_ok,want", AUX_LAYER_ID_CASES)
def test_aux_layer_ids_one_default_and_one_range(ids, num_layers, last_ok, want):
    field = "capture.aux_layer_ids"
    if isinstance(want, str):
        with pytest.raises(ConfigError, match=want):
            if ids is None:
                AuxLayerIds.resolve(None, num_layers, field)
            else:
                AuxLayerIds(tuple(ids)).check(num_layers, field, last_ok=last_ok)
        if ids is not None:  # preflight lists the same line instead of raising
            problem = AuxLayerIds(tuple(ids)).problem(num_layers, field, last_ok)
            assert problem.startswith(f"{field} = {ids}: ")
        return
    if last_ok:
        got = AuxLayerIds(tuple(ids)).check(num_layers, field, last_ok=True)
    else:
        got = AuxLayerIds.resolve(ids, num_layers, field)
    assert got.as_list() == want and list(got) == want and len(got) == len(want)
    assert AuxLayerIds(tuple(want)).problem(num_layers, field, last_ok) is None


def test_require_names_the_flag():
    with pytest.raises(ConfigError, match="--captured"):
        TrainConfig(target="t").require("target", "captured")
    TrainConfig(target="t", captured="c").require("target", "captured")


def test_every_cli_flag_maps_to_a_field():
    args = build_parser().parse_args(
        [
            "train",
            "--target",
            "T",
            "--captured",
            "C",
            "--vocab",
            "V",
            "--out",
            "O",
            "--loss-ttt-steps",
            "3",
            "--optimizer-lr",
            "0.001",
            "--no-checkpoint-resume",
            "--draft-intermediate-size",
            "512",
        ]
    )
    cfg = stage_config_from_args("train", args)
    got = (cfg.loss.ttt_steps, cfg.optimizer.lr, cfg.checkpoint.resume, cfg.draft.intermediate_size)
    assert got == (3, 1e-3, False, 512)
    assert cfg.out == Path("O")


def test_pipeline_resolution_fills_paths():
    cfg = PipelineConfig(target="T", data="D.jsonl", work_dir=Path("w")).resolved()
    assert cfg.regenerate.data == "D.jsonl"
    assert cfg.prepare.data == str(Path("w/regenerated/conversations.jsonl"))
    assert cfg.capture.data == str(Path("w/prepared"))
    assert cfg.train.captured == str(Path("w/captured"))
    cfg2 = PipelineConfig(target="T", data="D.jsonl", regenerate={"enabled": False}).resolved()
    assert cfg2.prepare.data == "D.jsonl"


@pytest.mark.parametrize("section", ["capture", "train"])
def test_old_layers_key_is_an_error_naming_the_new_key(tmp_path, section):
    """The aux ids are `aux_layer_ids` since 2026-12-01: an old `layers:` key is refused, naming the
    new key."""
    p = tmp_path / "c.yaml"
    p.write_text(f"target: t\ndata: d\n{section}:\n  layers: [2, 4, 5]\n")
    with pytest.raises(
        ConfigError, match=rf"{section}\.layers: renamed to {section}\.aux_layer_ids"
    ):
        load_pipeline_config(p)
    with pytest.raises(ConfigError, match=r"layers: renamed to aux_layer_ids"):
        build_stage_config(section, {"layers": [2, 4, 5]})
    p.write_text(f"target: t\ndata: d\n{section}:\n  aux_layer_ids: [2, 4, 5]\n")
    assert getattr(load_pipeline_config(p), section).aux_layer_ids == [2, 4, 5]


def test_num_speculative_tokens_is_set_once_in_evaluate():
    """train picks its best checkpoint at the k evaluate serves with; a different train value is
    refused."""
    cfg = PipelineConfig(target="t", data="d", evaluate={"num_speculative_tokens": 5}).resolved()
    assert cfg.train.num_speculative_tokens == 5 and cfg.evaluate.num_speculative_tokens == 5
    assert cfg.stream_stages()[1].num_speculative_tokens == 5
    assert PipelineConfig(target="t", data="d").resolved().train.num_speculative_tokens == 3
    PipelineConfig.model_validate(cfg.model_dump())  # a resolved config (same k in both) reloads
    with pytest.raises(
        ValueError,
        match=r"train.num_speculative_tokens = 4 but evaluate.num_speculative_tokens = 3",
    ):
        PipelineConfig(target="t", data="d", train={"num_speculative_tokens": 4})
    assert (
        TrainConfig().num_speculative_tokens is None
    )  # standalone: the default k (3) at selection


def test_records_with_old_key_names_are_migrated():
    from eagle3.artifacts import migrate_record

    old = {
        "layers": [1, 2, 4],
        "captured_layers": [1, 2, 4, 5],
        "hidden_size": 8,
        "train_config": {"layers": [1, 2], "lr": 1e-3},
    }
    new = migrate_record(old)
    assert new == {
        "aux_layer_ids": [1, 2, 4],
        "captured_aux_layer_ids": [1, 2, 4, 5],
        "hidden_size": 8,
        "train_config": {"aux_layer_ids": [1, 2], "optimizer": {"lr": 1e-3}},
    }
    assert old["layers"] == [1, 2, 4]  # the input is left as it was
    assert migrate_record(new) == new


def test_a_renamed_flag_names_the_new_one(capsys):
    from eagle3.cli import main

    with pytest.raises(SystemExit) as e:
        main(["capture", "--layers", "2,4,5"])
    assert e.value.code == 2
    assert "--layers was renamed to --aux-layer-ids" in capsys.readouterr().err


def test_flat_train_keys_of_earlier_versions_are_named_with_their_group(tmp_path):
    """A YAML written for the flat train section of earlier versions is refused with every moved
    key and its place now (one message, so the file is fixed at once); EAGLE-3.1's switches name
    the draft family."""
    p = tmp_path / "old.yaml"
    p.write_text(
        "target: t\ndata: d\ntrain:\n  epochs: 2\n  lr: 1.0e-4\n  warmup_steps: 500\n"
        "  schedule: linear\n  max_seq_len: 4096\n  keep_checkpoints: 2\n"
        "refine:\n  lr: 2.0e-5\n  batch_size: 2\n"
    )
    with pytest.raises(ConfigError) as e:
        load_pipeline_config(p)
    msg = str(e.value)
    for moved in (
        "train.lr moved to train.optimizer.lr",
        "train.warmup_steps moved to train.schedule.warmup_steps",
        "train.schedule moved to train.schedule.decay",
        "train.max_seq_len moved to train.loader.max_seq_len",
        "train.keep_checkpoints moved to train.checkpoint.keep",
        "refine.lr moved to refine.optimizer.lr",
    ):
        assert moved in msg, (moved, msg)
    assert "same meaning and values" in msg and "epochs" not in msg
    p.write_text("target: t\ndata: d\ntrain:\n  draft:\n    fc_norm: true\n    norm_output: true\n")
    with pytest.raises(
        ConfigError,
        match=r"train.draft.fc_norm moved to train.draft.family.*"
        r"is the draft family eagle3.1",
    ):
        load_pipeline_config(p)
    p.write_text(
        "target: t\ndata: d\ntrain:\n  optimizer:\n    lr: 1.0e-4\n"
        "  schedule:\n    decay: linear\n  draft:\n    family: eagle3.1\n"
    )
    train = load_pipeline_config(p).train
    assert (train.optimizer.lr, train.schedule.decay, train.draft.family) == (
        1e-4,
        "linear",
        "eagle3.1",
    )


@pytest.mark.parametrize(
    "flags,new",
    [
        (["--lr", "1e-3"], "--optimizer-lr"),
        (["--schedule", "cosine"], "--schedule-decay"),
        (["--parallel", "ddp"], "--runtime-parallel"),
        (["--keep-checkpoints", "2"], "--checkpoint-keep"),
        (["--draft-fc-norm"], "--draft-family"),
    ],
)
def test_a_moved_train_flag_names_its_new_one(capsys, flags, new):
    from eagle3.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", *flags])
    assert e.value.code == 2
    assert f"{flags[0]} was renamed to {new}" in capsys.readouterr().err


def test_train_help_lists_each_group_under_its_name(capsys):
    from eagle3.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    for group in ("loader", "draft", "loss", "optimizer", "schedule", "checkpoint", "runtime"):
        assert f"\n{group}:\n" in out, group
    assert "--optimizer-lr" in out and "--loss-decay" in out and "--lr " not in out


def test_older_flat_train_records_are_put_into_groups():
    """A checkpoint's train_config of earlier versions (flat; EAGLE-3.1 as draft.fc_norm /
    draft.norm_output) reads back in groups; a grouped one is left as it is."""
    from eagle3.artifacts import migrate_record

    old = {
        "epochs": 2.0,
        "lr": 3e-3,
        "schedule": "linear",
        "warmup_steps": 10,
        "loss_decay": 0.7,
        "num_loader_workers": 4,
        "freeze": ["lm_head"],
        "draft": {"num_hidden_layers": 2, "fc_norm": True, "norm_output": True},
        "parallel": "ddp",
    }
    new = migrate_record({"train_config": old})["train_config"]
    assert new == {
        "epochs": 2.0,
        "optimizer": {"lr": 3e-3},
        "schedule": {"decay": "linear", "warmup_steps": 10},
        "loss": {"decay": 0.7},
        "loader": {"num_workers": 4},
        "draft": {"num_hidden_layers": 2, "family": "eagle3.1", "freeze": ["lm_head"]},
        "runtime": {"parallel": "ddp"},
    }
    assert migrate_record({"train_config": new})["train_config"] == new
    TrainConfig.model_validate(new)  # a config of this version again


def test_refine_composes_the_train_groups_with_its_own_defaults():
    """refine's optimizer and schedule are train's groups (the same fields), with a lower lr and a
    shorter warmup by default, also when only another field of the group is set."""
    from eagle3.config import RefineConfig
    from eagle3.config.train_options import OptimizerOptions, ScheduleOptions

    r = RefineConfig(optimizer={"beta2": 0.99}, schedule={"decay": "linear"})
    assert isinstance(r.optimizer, OptimizerOptions) and isinstance(r.schedule, ScheduleOptions)
    assert (r.optimizer.lr, r.optimizer.beta2, r.schedule.warmup_steps) == (2e-5, 0.99, 10)
    assert set(type(r.optimizer).model_fields) == set(OptimizerOptions.model_fields)
    assert TrainConfig().optimizer.lr == 1e-4 and TrainConfig().schedule.warmup_steps == 50


def test_one_compute_dtype_type_for_every_stage_that_runs_the_target():
    import typing

    from eagle3.config import (
        CaptureConfig,
        EvaluateConfig,
        RefineConfig,
        RegenerateConfig,
        SynthesizeConfig,
    )
    from eagle3.config.fields import ComputeDtype

    for cls in (CaptureConfig, EvaluateConfig, RefineConfig, RegenerateConfig, SynthesizeConfig):
        assert cls.model_fields["dtype"].annotation == ComputeDtype, cls
    assert typing.get_args(ComputeDtype) == ("auto", "bfloat16", "float16", "float32")
