"""benchmarks/realbench/report.py: a row's training data comes from the captures the draft was
trained on."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location(
        "realbench_report", REPO / "benchmarks" / "realbench" / "report.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_data_is_read_from_the_draft_not_its_name(tmp_path: Path) -> None:
    report = _report()
    meta = tmp_path / "eagle3_draft.json"
    meta.write_text(json.dumps({"captured": "/w/cap_gsm8k,/w/cap_synth,/w/cap_chat"}))
    assert (
        report.train_data_of(meta, "nofeat") == "mix"
    )  # a sweep's name says nothing about its data
    meta.write_text(json.dumps({"captured": "/w/cap_synth"}))
    assert report.train_data_of(meta, "eagle3.1-mix") == "synth"  # the record wins over the name
    assert (
        report.train_data_of(tmp_path / "absent.json", "eagle3.1-gsm8k") == "gsm8k"
    )  # no record: the name's suffix


def _draft(root: Path, name: str, config: dict, meta: dict | None = None) -> None:
    d = root / "drafts" / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config))
    if meta is not None:
        (d / "eagle3_draft.json").write_text(json.dumps(meta))


def test_the_method_comes_from_the_drafts_files(tmp_path: Path) -> None:
    report = _report()
    ours = {"num_hidden_layers": 1, "intermediate_size": 1536, "fc_norm": True, "norm_output": True}
    _draft(tmp_path, "eagle3.1-mix", ours, {"captured": "/w/cap_gsm8k,/w/cap_chat"})
    _draft(
        tmp_path,
        "eagle3.1-mix-refine",
        ours,
        {"captured": "/w/cap_gsm8k,/w/cap_chat", "refine": {"rounds": 2}},
    )
    _draft(tmp_path, "late", ours, {"captured": "/w/cap_synth", "refined_from": "/w/train"})
    _draft(
        tmp_path,
        "peer-mix",
        {
            "speculators_model_type": "eagle3",
            "transformer_layer_config": {"num_hidden_layers": 1, "intermediate_size": 1536},
        },
    )
    assert report.draft_shape(tmp_path, "eagle3.1-mix")["method"] == "eagle3.1"
    assert report.draft_shape(tmp_path, "eagle3.1-mix-refine")["method"] == "eagle3.1+refine"
    assert report.draft_shape(tmp_path, "late") == {
        "method": "eagle3.1+refine",
        "draft_layers": 1,
        "draft_intermediate_size": 1536,
        "train_data": "synth",
    }
    peer = report.draft_shape(tmp_path, "peer-mix")
    assert peer["method"] == "speculators" and peer["train_data"] == "mix"
    assert report.method_of("eagle3.1-mix-refine") == ("eagle3.1", "mix")


def test_goals_per_category(tmp_path: Path) -> None:
    report = _report()

    def rows(method, values, temp=0.0):
        return [
            {"method": method, "temperature": temp, "category": c, "tokens_per_step": v}
            for c, v in values.items()
        ]

    table = (
        rows("ngram", {"math": 1.2, "chat": 1.1, "all": 1.15})
        + rows("speculators", {"math": 2.4, "chat": 2.0, "all": 2.2})
        + rows("eagle3.1", {"math": 2.5, "chat": 1.9, "all": 2.3})
        + rows("eagle3.1+refine", {"math": 3.0, "chat": 2.3, "all": 2.7})
        + rows("eagle3.1", {"math": 9.0, "chat": 9.0, "all": 9.0}, temp=0.6)
    )  # sampled rows: not a goal
    g = report.goals(table)
    assert not g["ours_ge_peer"]["met"] and g["ours_ge_peer"]["missed"] == ["chat"]
    assert g["refine_ge_1.15x_ours"]["met"] and g["refine_ge_1.10x_peer"]["met"]
    assert not g["ours_ge_2x_ngram"]["met"] and g["ours_ge_2x_ngram"]["missed"] == ["chat"]
    assert g["ours_ge_peer"]["ratio"]["math"] == round(2.5 / 2.4, 3)


def test_stage_walls_from_the_timings(tmp_path: Path) -> None:
    report = _report()
    (tmp_path / "timings.txt").write_text(
        "2026-12-03T09:00:00Z train-start\nrefine available: 1 (REFINE_RUN=eagle3.1-mix)\n"
        "train eagle3.1-mix rc=0 wall_s=251 2026-12-03T09:04:11Z\npeer convert wall_s=74 "
        "2026-12-03T09:01:14Z\n"
        "refine eagle3.1-mix rc=124 wall_s=480 2026-12-03T09:12:11Z\ntrain peer-mix rc=0 "
        "wall_s=402 x\n"
    )
    assert report.walls(tmp_path) == {
        "train eagle3.1-mix": {"wall_s": 251, "rc": "0"},
        "peer convert": {"wall_s": 74, "rc": None},
        "refine eagle3.1-mix": {"wall_s": 480, "rc": "124"},
        "train peer-mix": {"wall_s": 402, "rc": "0"},
    }
