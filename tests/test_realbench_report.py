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


def test_a_cached_evaluation_is_reused_only_with_its_own_settings(tmp_path: Path) -> None:
    import argparse

    import pytest

    report = _report()
    args = argparse.Namespace(k=3, max_tokens=96, dtype="float32")
    res = report.piece_path(tmp_path, "eagle3.1-mix", "0.0", args)
    assert res == tmp_path / "eval" / "eagle3.1-mix" / "k3-96tok" / "T0.0" / "results.json"
    res.parent.mkdir(parents=True)
    res.write_text(
        json.dumps(
            {
                "config": {
                    "num_speculative_tokens": 3,
                    "max_tokens": 96,
                    "dtype": "float32",
                    "temperatures": [0.0],
                }
            }
        )
    )
    report.check_piece(res, "0.0", args)  # the same settings: reused
    with pytest.raises(SystemExit, match=r"max_tokens 96 \(cached\) != 256 \(asked\)"):
        report.check_piece(res, "0.0", argparse.Namespace(k=3, max_tokens=256, dtype="float32"))


def _report_args(tmp_path: Path):
    """A report at k = 3 and 96 answer tokens, with an empty GPU report folder under tmp_path."""
    import argparse

    (tmp_path / "timings.txt").write_text("")
    return argparse.Namespace(
        k=3,
        max_tokens=96,
        dtype="float32",
        methods=None,
        prompts=tmp_path / "p.jsonl",
        results_name="x",
    )


def _evaluation(tau: float, **top) -> dict:
    """An evaluation's results with rows for math and all at `tau`, and `top` keys."""
    return {
        **top,
        "rows": [
            {
                "category": c,
                "temperature": 0.0,
                "num_prompts": 1,
                "tau": tau,
                "generated_tokens": 100,
                "num_accepted_tokens": round(100 - 100 / tau),
                "num_drafts": 10,
            }
            for c in ("math", "all")
        ],
    }


def test_rows_at_another_k_get_their_own_table_and_no_goal(tmp_path: Path) -> None:
    report = _report()
    args = _report_args(tmp_path)
    three = _evaluation(2.5, num_speculative_tokens=3)
    five = _evaluation(4.0, num_speculative_tokens=5)
    built = report.build([], {"ngram": three}, tmp_path, args, [("ngram", five)])
    assert [r.get("k") for r in built["rows"]] == [None, None, 5, 5]
    text = report.render(built)
    assert "## temperature 0.0 (greedy)\n" in text and "## temperature 0.0 (greedy), k = 5" in text
    k5 = text.split("k = 5")[1]
    assert "| ngram | ngram | — | 5 | 4.00 / 4.00 |" in k5 and "2.50" not in k5
    assert report._cells(built["rows"], "ngram", 0.0) == {"math": 2.5, "all": 2.5}


def test_rows_at_another_answer_length_get_their_own_table_and_no_goal(tmp_path: Path) -> None:
    report = _report()
    args = _report_args(tmp_path)

    def ev(max_tokens, tau):
        return _evaluation(tau, num_speculative_tokens=3, config={"max_tokens": max_tokens})

    built = report.build([], {"ngram": ev(96, 2.5)}, tmp_path, args, [("ngram", ev(256, 4.0))])
    assert [r.get("max_tokens") for r in built["rows"]] == [None, None, 256, 256]
    text = report.render(built)
    assert "## temperature 0.0 (greedy), 256 answer tokens" in text
    longer = text.split("256 answer tokens")[1]
    assert "| ngram | ngram | — | 3 | 4.00 / 4.00 |" in longer and "2.50" not in longer
    assert report._cells(built["rows"], "ngram", 0.0) == {"math": 2.5, "all": 2.5}


def _pack(gpu_dir: Path, files: dict[str, str], num_parts: int = 2) -> None:
    """host.sh collect's pieces: a tar.xz of the run's out/ folder, split into parts."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as t:
        for path, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"out/{path}")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    cut = len(blob) // num_parts
    for old in gpu_dir.glob("out.tar.xz.part*"):
        old.unlink()
    for i in range(num_parts):
        piece = blob[i * cut : (i + 1) * cut if i < num_parts - 1 else len(blob)]
        (gpu_dir / f"out.tar.xz.part{i:02d}").write_bytes(piece)


def test_drafts_are_unpacked_once_and_whole(tmp_path: Path) -> None:
    import pytest

    report = _report()
    gpu, out = tmp_path / "gpu", tmp_path / "out"
    gpu.mkdir()
    with pytest.raises(SystemExit, match="no out.tar.xz.partNN"):
        report.unpack(gpu, out)
    logs = "train/d1/logs/metrics.jsonl"
    _pack(gpu, {"drafts/d1/config.json": '{"v": 1}', logs: "{}\n", "timings.txt": "t\n"})
    assert report.unpack(gpu, out) == ["d1"]
    config = out / "drafts" / "d1" / "config.json"
    assert json.loads(config.read_text()) == {"v": 1} and (out / logs).is_file()
    assert report.report_dir(out) == out
    # unchanged pieces: the files an engine may be reading are not written again
    before = config.stat().st_mtime_ns
    report.unpack(gpu, out)
    assert config.stat().st_mtime_ns == before
    # new pieces (another GPU run into the same dir): unpacked over the old files, nothing left
    # half-way
    _pack(gpu, {"drafts/d1/config.json": '{"v": 2}', "drafts/d2/config.json": "{}"}, num_parts=3)
    assert report.unpack(gpu, out) == ["d1", "d2"]
    assert json.loads(config.read_text()) == {"v": 2}
    assert not (out / ".unpacking").exists()
