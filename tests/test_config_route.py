"""scripts/config_route.py (the config route of docs/structure.md) records what it says: the calls
of eagle3 functions that receive a config, once per call edge, and counts stops, modules, visits
and climbs against the layers of pyproject.toml."""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("config_route", ROOT / "scripts/config_route.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_module(name: str, source: str, **names) -> types.ModuleType:
    """A module named `name` (as the recorder sees it: its globals' __name__) run from source."""
    module = types.ModuleType(name)
    module.__dict__.update(names)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def test_the_recorder_follows_the_config_once_per_edge_and_not_other_arguments():
    from eagle3.config import CaptureConfig

    route = load_script()
    low = fake_module(
        "eagle3.low",
        "def use(cfg):\n    return cfg.batch_tokens\n\ndef plain(n):\n    return n + 1\n",
    )
    high = fake_module(
        "eagle3.high",
        "def run(cfg):\n"
        "    for _ in range(3):\n"
        "        low.use(cfg)\n"
        "    low.plain(2)\n"
        "    return [low.use(c) for c in [cfg]]\n",
        low=low,
    )
    rec = route.RouteRecorder()
    sys.setprofile(rec)
    try:
        high.run(CaptureConfig())
    finally:
        sys.setprofile(None)
    edges = sorted(rec.edges, key=rec.edges.__getitem__)
    caller = edges[0][0]  # this test, outside eagle3
    assert edges == [(caller, "eagle3.high:run"), ("eagle3.high:run", "eagle3.low:use")]


def test_figures_count_visits_and_climbs_by_the_layers(tmp_path):
    route = load_script()
    (tmp_path / "pyproject.toml").write_text(
        "[[tool.importlinter.contracts]]\n"
        'id = "library-layers"\ntype = "layers"\ncontainers = ["eagle3"]\n'
        'layers = ["pipeline", "capture | train", "config : io"]\n'
    )
    ranks = route.layer_ranks(tmp_path / "pyproject.toml")
    assert ranks == {"pipeline": 0, "capture": 1, "train": 1, "config": 2, "io": 2}
    edges = [
        ("(outside)", "eagle3.pipeline:run"),
        ("eagle3.pipeline:run", "eagle3.capture.run:capture"),
        ("eagle3.capture.run:capture", "eagle3.capture.run:_inputs"),  # inside: no visit
        ("eagle3.capture.run:capture", "eagle3.config:StageConfig.require"),
        ("eagle3.capture.spool:produce", "eagle3.capture.run:_inputs"),  # a second way in
        ("eagle3.config:PipelineConfig.hook", "eagle3.train.loop:step"),  # handed back up
    ]
    f = route.figures(edges, ranks)
    assert (f["stops"], f["modules"], f["edges"]) == (5, 4, 6)
    assert f["visits_per_module"] == {
        "eagle3.capture.run": 2,
        "eagle3.pipeline": 1,
        "eagle3.config": 1,
        "eagle3.train.loop": 1,
    }
    assert f["visits"] == 5
    assert f["climb_edges"] == ["eagle3.config:PipelineConfig.hook -> eagle3.train.loop:step"]
    assert threading.getprofile() is None  # nothing left installed
