"""benchmarks/realbench/report.py: a row's training data comes from the captures the draft was trained on."""

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("realbench_report", REPO / "benchmarks" / "realbench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_train_data_is_read_from_the_draft_not_its_name(tmp_path: Path) -> None:
    report = _report()
    meta = tmp_path / "eagle3_draft.json"
    meta.write_text(json.dumps({"captured": "/w/cap_gsm8k,/w/cap_synth,/w/cap_chat"}))
    assert report.train_data_of(meta, "nofeat") == "mix"  # a sweep's name says nothing about its data
    meta.write_text(json.dumps({"captured": "/w/cap_synth"}))
    assert report.train_data_of(meta, "eagle3.1-mix") == "synth"  # the record wins over the name
    assert report.train_data_of(tmp_path / "absent.json", "eagle3.1-gsm8k") == "gsm8k"  # no record: the name's suffix
