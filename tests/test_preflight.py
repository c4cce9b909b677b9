"""eagle3.preflight: every config problem found before any stage runs, each naming field, value and
fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle3.config import ConfigError
from eagle3.preflight import check_pipeline, require_pipeline
from test_flows import tiny_config


def test_a_good_config_passes(tiny_llama, tmp_path):
    assert check_pipeline(tiny_config(tiny_llama, tmp_path)) == []
    assert (
        check_pipeline(
            tiny_config(tiny_llama, tmp_path, capture={"aux_layer_ids": [1, 2, 4]}),
            [[1, 2], [3, 4]],
        )
        == []
    )


def test_every_problem_is_listed_with_field_value_and_fix(tiny_llama, tmp_path):
    cfg = tiny_config(
        tiny_llama, tmp_path, capture={"aux_layer_ids": [1, 2, 9]}, train={"aux_layer_ids": [1, 3]}
    )
    problems = check_pipeline(cfg, [[1, 2, 3], [2, 7]])
    assert problems[0].startswith(
        "capture.aux_layer_ids = [1, 2, 9]: id(s) [9] out of range for this 5-layer target; "
        "use ids in 1..4"
    ), problems
    assert problems[1].startswith("layer_sets[1] = [2, 7]: id(s) [7] out of range"), problems
    assert problems[2].startswith(
        "train.aux_layer_ids = [1, 3]: id(s) [3] are not in capture.aux_layer_ids = [1, 2, 9]"
    ), problems
    with pytest.raises(
        ConfigError, match=r"pipeline tiny: the config cannot run .*\n  - capture.aux_layer_ids"
    ):
        require_pipeline(cfg)


def test_missing_paths(tiny_llama, tmp_path):
    cfg = tiny_config(tiny_llama, tmp_path)
    cfg.target, cfg.data, cfg.eval_prompts = (
        str(tmp_path / "no-model"),
        str(tmp_path / "no.jsonl"),
        "gone.jsonl",
    )
    problems = check_pipeline(cfg)
    assert any(p.startswith(f"target = {cfg.target!r} has no config.json") for p in problems), (
        problems
    )
    assert any(p.startswith(f"data = {cfg.data!r} does not exist") for p in problems), problems
    assert any(p.startswith("eval_prompts = 'gone.jsonl' does not exist") for p in problems), (
        problems
    )


def test_a_missing_path_does_not_hide_the_other_problems(tiny_llama, tmp_path):
    """One pass: a missing eval_prompts file is listed next to the two bad aux-id lists it used to
    hide."""
    cfg = tiny_config(
        tiny_llama,
        tmp_path,
        eval_prompts=False,
        capture={"aux_layer_ids": [1, 2, 9]},
        train={"aux_layer_ids": [1, 3]},
    )
    cfg.eval_prompts = str(tmp_path / "gone.jsonl")
    problems = check_pipeline(cfg, [[2, 7]])
    assert len(problems) == 4, problems
    assert problems[0].startswith(f"eval_prompts = {cfg.eval_prompts!r} does not exist"), problems
    assert problems[1].startswith("capture.aux_layer_ids = [1, 2, 9]: id(s) [9] out of range"), (
        problems
    )
    assert problems[2].startswith("layer_sets[0] = [2, 7]: id(s) [7] out of range"), problems
    assert problems[3].startswith("train.aux_layer_ids = [1, 3]: id(s) [3] are not in"), problems


def test_capture_that_cannot_fit_the_disk(tiny_llama, tmp_path):
    """Once prepare's manifest gives the token count, the planner's disk check runs before
    capture."""
    cfg = tiny_config(tiny_llama, tmp_path, capture={"min_free_disk_gb": 1e9})
    assert check_pipeline(cfg) == []  # no prepared data yet: capture checks again itself
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "manifest.json").write_text(json.dumps({"num_samples": 8, "num_tokens": 1000}))
    problems = check_pipeline(cfg)
    assert len(problems) == 1 and "min_free_disk_gb = 1000000000.0 GB kept free" in problems[0], (
        problems
    )
    assert "Fixes: --storage-dtype fp8" in problems[0]


def test_work_dir_lock_is_released_when_its_holder_is_killed(tmp_path):
    """One writer per work dir; a SIGKILLed holder leaves it free (the kernel drops the flock)."""
    from eagle3.lock import LockedError, dir_lock

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from eagle3.lock import dir_lock\n"
            "with dir_lock(sys.argv[1], 'pipeline work_dir'):\n    print('held', flush=True); "
            "time.sleep(600)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            LockedError, match=rf"pipeline work_dir {tmp_path} is being written by pid {holder.pid}"
        ):
            with dir_lock(tmp_path, "pipeline work_dir"):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    t0 = time.time()
    with dir_lock(tmp_path, "pipeline work_dir") as path:
        assert json.loads(Path(path).read_text())["pid"] == os.getpid()
    assert time.time() - t0 < 5


def test_work_dir_lock_names_the_flow_run_that_holds_it(tmp_path):
    """The lock records the holder's flow run (name, id, link): a second writer's error names it,
    and the writer that takes over from a killed holder is handed that record (to close the lost
    run)."""
    from eagle3.lock import LockedError, dir_lock

    run = {
        "flow_run_name": "tiny-pipeline-gentle-owl",
        "flow_run_id": "0b5e-id",
        "flow_run_url": "http://127.0.0.1:4200/runs/flow-run/0b5e-id",
    }
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import json, sys, time; from eagle3.lock import dir_lock\n"
            "with dir_lock(sys.argv[1], 'pipeline work_dir', holder=json.loads(sys.argv[2])):\n"
            "    print('held', flush=True); time.sleep(600)",
            str(tmp_path),
            json.dumps(run),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockedError) as e:
            with dir_lock(tmp_path, "pipeline work_dir"):
                pass
        assert (
            "is being written by flow run 'tiny-pipeline-gentle-owl' "
            f"(0b5e-id, {run['flow_run_url']}): "
            f"pid {holder.pid} on host"
        ) in str(e.value), e.value
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
    stale: list[dict] = []
    with dir_lock(
        tmp_path, "pipeline work_dir", holder={"flow_run_name": "next"}, on_stale=stale.append
    ) as path:
        assert json.loads(Path(path).read_text())["flow_run_name"] == "next"
    assert (
        len(stale) == 1 and stale[0]["flow_run_id"] == "0b5e-id" and stale[0]["state"] == "dead"
    ), stale
