"""Unit tests of the Prefect layer's pieces that need no API: retry classification, the subprocess
runner (streaming, crash, timeout + process-group kill), cache keys and output verification,
prefect.yaml."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_retry_classification():
    from eagle3.config import ConfigError
    from eagle3_prefect.tasks.errors import (
        EngineStartError,
        StageCrashed,
        StageOOMError,
        classify_exception,
        is_transient,
    )

    assert not is_transient(ConfigError("train.lr = -1: must be > 0"))
    assert not is_transient(FileNotFoundError("no such data"))
    assert not is_transient(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_transient(StageOOMError("train", "OutOfMemoryError: ..."))
    assert is_transient(StageCrashed("capture", "killed by signal 9"))
    assert is_transient(EngineStartError("evaluate", "engine core initialization failed"))
    assert (
        classify_exception(RuntimeError("Engine core initialization failed. See root cause above"))
        == "engine_start"
    )
    assert is_transient(RuntimeError("NCCL watchdog timeout"))


def _patch_child(monkeypatch, code: str):
    import eagle3_prefect.tasks.subprocess_runner as runner

    monkeypatch.setattr(
        runner, "build_command", lambda stage, c, r: [sys.executable, "-u", "-c", code, str(r)]
    )
    return runner


def test_subprocess_streams_output_and_progress(monkeypatch):
    code = (
        "import json, sys\nfor i in range(1, 5): print(f'step {i}/4 loss 1.0', flush=True)\n"
        "open(sys.argv[1], 'w').write(json.dumps({'ok': True, 'result': {'n': 4}}))"
    )
    runner = _patch_child(monkeypatch, code)
    seen, progress = [], []

    class Log:
        def info(self, fmt, *args):
            seen.append(fmt % args)

    assert runner.run_stage_subprocess("train", {}, log=Log(), on_progress=progress.append) == {
        "n": 4
    }
    assert any("step 4/4 loss" in s for s in seen)
    assert runner.parse_progress(" 45%|####      | 9/20 [00:01<00:02]") == pytest.approx(0.45)


def test_subprocess_classified_failures(monkeypatch):
    from eagle3_prefect.tasks.errors import StageConfigError, StageCrashed, StageOOMError

    code = (
        "import json, sys\nopen(sys.argv[1], 'w').write(json.dumps({'ok': False, 'kind': 'config', "
        "'type': 'ConfigError', 'message': 'capture.aux_layer_ids = [99]: the target has 5 "
        "layers'}))\nsys.exit(2)"
    )
    runner = _patch_child(monkeypatch, code)
    with pytest.raises(StageConfigError, match=r"capture.aux_layer_ids = \[99\]"):
        runner.run_stage_subprocess("capture", {})
    runner = _patch_child(monkeypatch, code.replace("'config'", "'oom'"))
    with pytest.raises(StageOOMError):
        runner.run_stage_subprocess("capture", {})
    runner = _patch_child(monkeypatch, "import os; os.kill(os.getpid(), 9)")
    with pytest.raises(StageCrashed, match="killed by signal 9"):
        runner.run_stage_subprocess("capture", {})


def test_subprocess_timeout_kills_the_process_group(monkeypatch, tmp_path):
    from eagle3_prefect.tasks.errors import StageTimeout

    pidfile = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys, time\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\ntime.sleep(300)"
    )
    runner = _patch_child(monkeypatch, code)
    monkeypatch.setattr(runner, "KILL_GRACE_S", 2.0)
    t0 = time.time()
    with pytest.raises(StageTimeout, match="timeout_s=2"):
        runner.run_stage_subprocess("train", {}, timeout_s=2)
    assert time.time() - t0 < 20
    gpid = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(gpid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {gpid} survived the process-group kill")


def test_stage_main_reports_config_errors(tmp_path):
    import json
    import subprocess

    cfg = tmp_path / "c.json"
    cfg.write_text(
        json.dumps(
            {"data": str(tmp_path / "missing"), "out": str(tmp_path / "v"), "draft_vocab_size": 0}
        )
    )
    res = tmp_path / "r.json"
    env = dict(os.environ)  # eagle3_prefect is installed (pip install -e .)
    p = subprocess.run(
        [sys.executable, "-m", "eagle3_prefect.tasks._stage_main", "vocab", str(cfg), str(res)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    report = json.loads(res.read_text())
    assert report["kind"] == "config" and "draft_vocab_size" in report["message"]


def test_cache_key_and_verification(tmp_path):
    from eagle3.config import VocabConfig
    from eagle3_prefect.tasks.manifest import (
        content_sha256,
        list_outputs,
        prepare_out_dir,
        stage_cache_key,
        verify_outputs,
        write_stamp,
    )

    up = {"prepare": {"out": str(tmp_path / "prepared"), "content_sha256": "a" * 64}}
    cfg = VocabConfig(data=str(tmp_path / "prepared"), out=tmp_path / "vocab", draft_vocab_size=8)
    key = stage_cache_key("vocab", cfg, up)
    assert key == stage_cache_key("vocab", cfg.model_dump(mode="json"), up)
    assert key != stage_cache_key("vocab", cfg.model_copy(update={"draft_vocab_size": 9}), up)
    assert key != stage_cache_key(
        "vocab", cfg, {"prepare": {**up["prepare"], "content_sha256": "b" * 64}}
    )
    out = tmp_path / "vocab"
    out.mkdir()
    (out / "a.bin").write_bytes(b"12345")
    files = list_outputs(out)
    write_stamp(
        out, {"key": key, "status": "done", "files": files, "content_sha256": content_sha256(files)}
    )
    assert verify_outputs(out, key) == (True, "")
    assert not verify_outputs(out, key + "x")[0]
    os.utime(out / "a.bin", ns=(files["a.bin"][1] + 10**9,) * 2)  # touched, same bytes: still valid
    assert verify_outputs(out, key) == (True, "")
    (out / "a.bin").write_bytes(b"12346")  # same size, new content
    assert "altered" in verify_outputs(out, key)[1]
    (out / "a.bin").unlink()
    assert "missing" in verify_outputs(out, key)[1]
    assert prepare_out_dir("vocab", out, key + "other") == "removed output of a different config"
    assert list(out.iterdir()) == []


def test_cache_keys_follow_the_code_each_stage_runs(tmp_path, monkeypatch):
    """An edit to a module that evaluate reaches only through others (the vLLM engine module, the
    draft model) re-keys evaluate and leaves prepare cached; one to capture's engine child re-keys
    capture. The edits go to a copy of the package that the code version reads instead."""
    import shutil

    from eagle3 import code_version as versions
    from eagle3.config import CaptureConfig, EvaluateConfig, PrepareConfig
    from eagle3_prefect.tasks import manifest

    copy = tmp_path / "eagle3"
    shutil.copytree(
        versions.package_root(), copy, ignore=shutil.ignore_patterns("__pycache__", "assets")
    )
    monkeypatch.setattr(versions, "package_root", lambda: copy)
    configs = {
        "prepare": PrepareConfig(target=str(tmp_path / "t"), data=str(tmp_path / "d.jsonl")),
        "capture": CaptureConfig(target=str(tmp_path / "t"), data=str(tmp_path / "prepared")),
        "evaluate": EvaluateConfig(target=str(tmp_path / "t"), prompts=str(tmp_path / "p.jsonl")),
    }

    def keys() -> dict[str, str]:
        manifest.code_version.cache_clear()  # once per process otherwise
        return {stage: manifest.stage_cache_key(stage, cfg, {}) for stage, cfg in configs.items()}

    try:
        before = keys()
        for module, changed in (
            ("vllm_engine.py", {"capture", "evaluate"}),
            ("model/draft.py", {"evaluate"}),
            ("capture/engine_main.py", {"capture"}),
        ):
            text = (copy / module).read_text()
            (copy / module).write_text(text + "\n# edited\n")
            after = keys()
            assert {s for s in configs if after[s] != before[s]} == changed, module
            before = after
    finally:
        manifest.code_version.cache_clear()


def test_prefect_yaml_deployments():
    from eagle3.config import PipelineConfig, load_yaml

    doc = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    deps = doc["deployments"]
    assert all(d.get("enforce_parameter_schema") is True for d in deps)
    by = {(d["entrypoint"].split(":")[1], d["name"]): d for d in deps}
    pipeline = by[("eagle3_pipeline", "pipeline")]
    assert pipeline["work_pool"]["name"] == "cpu"
    assert pipeline["parameters"]["config"] == load_yaml(ROOT / "configs" / "demo.yaml")
    PipelineConfig.model_validate(pipeline["parameters"]["config"])
    retrain = by[("retrain", "retrain-nightly")]
    assert retrain["schedules"][0]["cron"]
    assert ("layer_sweep", "layer-sweep") in by
    from eagle3.stages import STAGES
    from eagle3_prefect.flows.dispatch import stage_deployment

    gpu_stages = [
        n for n, s in STAGES.items() if s.gpu
    ]  # the registry's GPU stages: one flow each, on both pools
    assert gpu_stages == ["regenerate", "capture", "train", "refine", "evaluate"]
    assert {
        fn.removesuffix("_stage") for fn, _ in by if fn.endswith("_stage") and "stream" not in fn
    } == set(gpu_stages)
    for stage in gpu_stages:
        for pool in (
            "gpu-1x",
            "gpu-8x",
        ):  # named for what it runs: "eagle3-train/stage · train · gpu-1x"
            d = by[(f"{stage}_stage", stage_deployment(stage, pool).split("/")[1])]
            assert d["work_pool"]["name"] == pool and "stage" in d["tags"]
            assert d["work_pool"]["job_variables"]["env"]["EAGLE3_GPU_LIMIT"]
    # the UI's deployment list (A to Z) leads with what a person runs: pipeline, sweep, retrain and
    # streaming, before the stage deployments the pipeline launches as subflows
    names = sorted(d["name"] for d in deps)
    assert names[:4] == ["layer-sweep", "pipeline", "retrain-nightly", "streaming"], names
    assert [d["name"] for d in deps if "entry" in d["tags"]] == [
        "pipeline",
        "retrain-nightly",
        "layer-sweep",
        "streaming",
    ]
    # every run sends Prefect's flow-run heartbeat every 30 s (the lost-run automation's clock)
    assert all(
        d["work_pool"]["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
        for d in deps
    )
    import importlib

    from prefect import Flow

    for d in (
        deps
    ):  # module entrypoints of the installed package (`prefect deploy` imports them the same way)
        path, fn = d["entrypoint"].split(":")
        assert path.startswith("eagle3_prefect.flows."), d["entrypoint"]
        flow = getattr(importlib.import_module(path), fn)
        assert isinstance(flow, Flow), d["entrypoint"]
    from eagle3_prefect.flows.gpu_stages import (
        capture_stage,  # typed by the registry's config class
    )

    assert capture_stage.parameters.properties["config"]["$ref"].endswith("CaptureConfig")


def test_cache_keys_use_absolute_paths(tmp_path, monkeypatch):
    """Two checkouts whose configs both say `runs/demo` key their stages apart; the same absolute
    dirs key alike."""
    from eagle3.config import VocabConfig
    from eagle3_prefect.tasks.manifest import stage_cache_key

    up = {"prepare": {"out": "runs/demo/prepared", "content_sha256": "a" * 64}}
    cfg = VocabConfig(data="runs/demo/prepared", out="runs/demo/vocab", draft_vocab_size=8)
    keys = []
    for checkout in ("one", "two"):
        (tmp_path / checkout).mkdir()
        monkeypatch.chdir(tmp_path / checkout)
        keys.append(stage_cache_key("vocab", cfg, up))
    assert keys[0] != keys[1]
    absolute = cfg.model_copy(
        update={
            "data": str(tmp_path / "two" / "runs/demo/prepared"),
            "out": tmp_path / "two" / "runs/demo/vocab",
        }
    )
    assert stage_cache_key("vocab", absolute, up) == keys[1]


def test_stage_output_goes_to_its_log_file_and_vllm_chatter_stays_there(monkeypatch, tmp_path):
    """The stage's whole output lands in <out>/.eagle3-logs/; the run's log gets eagle3's lines
    (warnings as warnings) and vLLM's errors, not vLLM's INFO/WARNING lines."""
    lines = [
        "train: step 1/2 loss 1.0",
        "WARNING eagle3.train: lr is high",
        "(EngineCore_DP0 pid=12) WARNING 12-03 07:01:02 [config.py:1] chunked prefill is off",
        "INFO 12-03 07:01:03 [core.py:2] init engine",
        "ERROR 12-03 07:01:04 [core.py:3] engine died",
    ]
    code = (
        "import json, sys\n"
        + "".join(f"print({line!r}, flush=True)\n" for line in lines)
        + "open(sys.argv[1], 'w').write(json.dumps({'ok': True, 'result': {}}))"
    )
    runner = _patch_child(monkeypatch, code)
    seen: list[tuple[str, str]] = []

    class Log:
        def info(self, fmt, *args):
            seen.append(("info", fmt % args))

        def warning(self, fmt, *args):
            seen.append(("warning", fmt % args))

    runner.run_stage_subprocess("train", {"out": str(tmp_path / "train")}, log=Log())
    relayed = [(level, text) for level, text in seen if "stage train:" not in text]
    assert relayed == [("info", lines[0]), ("warning", lines[1]), ("warning", lines[4])], seen
    (log_file,) = (tmp_path / "train" / ".eagle3-logs").glob("train-*.log")
    assert log_file.read_text().splitlines() == lines


def test_stale_stage_temp_dirs_are_removed(tmp_path):
    """A SIGKILLed stage run leaves its temp dir; the next stage run on the host removes it (not a
    live one's)."""
    import subprocess

    from eagle3_prefect.tasks.subprocess_runner import remove_stale_temp_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for pid in (dead.pid, os.getpid()):
        (tmp_path / f"eagle3-train-{pid}-a1b2c3").mkdir()
        (tmp_path / f"eagle3-train-{pid}-a1b2c3" / "config.json").write_text("{}")
    (tmp_path / "eagle3-train-notmine").mkdir()
    assert remove_stale_temp_dirs(tmp_path) == [f"eagle3-train-{dead.pid}-a1b2c3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"eagle3-train-{os.getpid()}-a1b2c3", "eagle3-train-notmine"]
    )


def test_one_config_error_is_one_error_record():
    """A config error reported by the task, the flow and the entrypoint is one ERROR record without
    a traceback (the traceback at DEBUG); "Finished in state Failed" restating it is INFO; a bug
    keeps its traceback."""
    import logging

    import eagle3_prefect.flows  # noqa: F401 - installs the filter
    from eagle3.config import ConfigError

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    loggers = [logging.getLogger(name) for name in ("prefect.task_runs", "prefect.flow_runs")]
    saved = [(lg.handlers, lg.level, lg.propagate) for lg in loggers]
    for lg in loggers:  # only this test's handler: Prefect's own would send the records to an API
        lg.handlers, lg.propagate = [Keep(level=logging.DEBUG)], False
        lg.setLevel(logging.DEBUG)
    try:
        err = ConfigError(
            "vocab.draft_vocab_size = 10000000: above the target's vocab (512); use 512 or less"
        )
        try:
            raise err
        except ConfigError:
            extra = {"flow_run_id": "run-1"}
            logging.getLogger("prefect.task_runs").error(
                "Task run failed with exception: %r", err, exc_info=True, extra=extra
            )
            logging.getLogger("prefect.task_runs").error(
                f"Finished in state Failed('Task run encountered an exception ConfigError: {err}')",
                extra=extra,
            )
            logging.getLogger("prefect.flow_runs").exception(
                "Encountered exception during execution: %r", err, extra=extra
            )
            logging.getLogger("prefect.flow_runs").error(
                "Engine execution exited with unexpected exception", exc_info=True, extra=extra
            )
        try:
            raise KeyError("bug")
        except KeyError:
            logging.getLogger("prefect.flow_runs").exception(
                "Encountered exception during execution", extra=extra
            )
    finally:
        for lg, (handlers, level, propagate) in zip(loggers, saved, strict=True):
            lg.handlers, lg.propagate = handlers, propagate
            lg.setLevel(level)
    errors = [r for r in records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        f"ConfigError: {err}",
        "Encountered exception during execution",
    ]
    assert (
        errors[0].exc_info is None and errors[1].exc_info is not None
    )  # the bug keeps its traceback
    assert sum(r.levelno == logging.DEBUG and r.exc_info is not None for r in records) == 3
    assert any(
        r.levelno == logging.INFO and r.getMessage().startswith("Finished in state Failed")
        for r in records
    )


def test_progress_probes_read_stage_files(tmp_path):
    import json
    from types import SimpleNamespace

    from eagle3_prefect.tasks.progress import make_probe

    train = SimpleNamespace(out=tmp_path / "train", max_steps=10, epochs=1.0)
    probe = make_probe("train", train)
    assert probe() is None
    (train.out / "logs").mkdir(parents=True)
    (train.out / "logs" / "metrics.jsonl").write_text(
        '{"step": 1}\n{"step": 4, "loss": 2.0}\n{"step": 4, "spl'
    )
    assert probe() == pytest.approx(0.4)
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "manifest.json").write_text(json.dumps({"num_samples": 20}))
    cap = SimpleNamespace(out=tmp_path / "cap", data=str(prepared), limit=8)
    cap.out.mkdir()
    (cap.out / "progress.json").write_text(
        json.dumps({"shards": [{"next_index": 2}, {"next_index": 6}]})
    )
    assert make_probe("capture", cap)() == pytest.approx(0.75)
    assert make_probe("export", cap) is None


def test_stage_process_dies_with_its_parent(tmp_path):
    """The task process is SIGKILLed: the stage process (own session) notices and stops its
    group."""
    import subprocess

    pidfile = tmp_path / "stage.pid"
    stage = (
        "import os, time\nfrom eagle3_prefect.tasks._stage_main import start_parent_watchdog\n"
        f"start_parent_watchdog(interval_s=0.2, grace_s=1)\nopen({str(pidfile)!r}, "
        "'w').write(str(os.getpid()))\n"
        "time.sleep(300)"
    )
    parent = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {stage!r}], "
        "start_new_session=True)\ntime.sleep(300)"
    )
    env = dict(os.environ)  # eagle3_prefect is installed (pip install -e .)
    p = subprocess.Popen([sys.executable, "-c", parent], env=env)
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.1)
    pid = int(pidfile.read_text())
    p.kill()
    p.wait()
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, 9)
    pytest.fail("the stage process outlived its parent")


def _evaluate_result() -> dict:
    """An evaluate result as the stage returns it (results.json's shape): the draft over every
    prompt, one category row, n-gram beside it (`compare: [ngram]`), plain decoding timed, and each
    method's predicted speed-up (eagle3.speedup on the Llama-3.1-8B shape, one H200): the draft's
    pays at one request, n-gram's (its lookup rarely matches) does not."""
    import json

    from eagle3.speedup import Acceptance, predict_speedups

    llama = json.loads((ROOT / "configs/targets/llama-3.1-8b.json").read_text())

    def predicted(method, rates, drafted):
        acc = Acceptance(rates, drafted, method)
        return predict_speedups(llama, "h200-device", 1, acc, None, 500).as_dict()

    def row(method, category, tau, drafts, accepted, generated, tps):
        return {
            "method": method,
            "category": category,
            "temperature": 0.0,
            "num_prompts": 16,
            "tau": tau,
            "num_drafts": drafts,
            "num_accepted_tokens": accepted,
            "generated_tokens": generated,
            "tokens_per_s": tps,
            "baseline_tokens_per_s": 60.123,
            "measured_speedup": round(tps / 60.123, 3),
            "tokens_per_step": round(generated / (generated - accepted), 4),
        }

    return {
        "out": "/data/runs/demo/evaluate",
        "method": "eagle3",
        "acceptance_length": 1.4523,
        "num_drafts": 500,
        "num_accepted_tokens": 226,
        "spec_tokens_per_s": 71.46,
        "baseline_tokens_per_s": 60.123,
        "speedup": 1.1886,
        "rows": [
            row("eagle3", "all", 1.4523, 500, 226, 734, 71.46),
            row("eagle3", "chat", 1.5, 250, 125, 400, 70.0),
        ],
        "comparisons": [row("ngram", "all", 2.7812, 60, 107, 734, 192.0)],
        "predicted_speedup": {
            "eagle3": predicted("eagle3", [0.3, 0.1, 0.05], 0.98),
            "ngram": predicted("ngram", [0.02, 0.01, 0.005], 0.12),
        },
    }


def test_the_result_line_and_the_comparison_lead_with_tokens_per_target_step():
    from eagle3_prefect.flows.report import result_line
    from eagle3_prefect.tasks.artifacts import comparison_table, method_rows

    rows = method_rows(_evaluate_result())
    assert [r["method"] for r in rows] == ["eagle3", "ngram", "plain"]
    draft, ngram, plain = rows
    assert draft["tokens_per_step"] == round(734 / (734 - 226), 2) == 1.44
    assert (draft["tau"], ngram["tau"], ngram["tokens_per_step"]) == (1.45, 2.78, 1.17)
    assert plain["tokens_per_s"] == 60.1 and plain["tokens_per_step"] == 1.0
    table = comparison_table(rows)
    k, x = draft["predicted_k"], draft["predicted_speedup"]
    assert k is not None and x > 1 and ngram["predicted_k"] is None
    assert "predicted speed-up (1 request, h200-device TP 1)" in table, table
    assert f"| draft (EAGLE-3) | 1.44 | 1.45 | 98% | 71.5 | {x:.2f}× (k {k}) | 1.19× |" in table
    assert "| n-gram | 1.17 | 2.78 | 10% | 192.0 | does not pay | 3.19× |" in table, table
    assert "| plain decoding | 1.00 | – |" in table, table
    manifests = {
        "export": {"out": "/data/runs/demo/draft"},
        "evaluate": {"result": _evaluate_result()},
    }
    line = result_line(manifests)
    assert line == (
        "draft 1.44 vs n-gram 1.17 tokens/target step (τ 1.45 vs 2.78); predicted on h200-device "
        f"TP 1 at one request: {x:.2f}× (k {k}) vs does not pay; draft /data/runs/demo/draft"
    )
    assert line[:60].endswith("(τ 1.45 vs 2.78")  # the Details tab shows ~70 characters
    alone = _evaluate_result()
    alone["comparisons"] = []
    manifests["evaluate"]["result"] = alone
    assert "n-gram not measured (evaluate.compare: [ngram])" in result_line(manifests)
    manifests["evaluate"]["result"] = {"acceptance_length": 1.2345}  # a result without rows
    assert result_line(manifests) == "draft τ 1.23; draft /data/runs/demo/draft"
    del manifests["evaluate"]
    assert result_line(manifests) == "not evaluated (no eval_prompts); draft /data/runs/demo/draft"


def test_the_summary_shows_each_methods_predicted_speedup_and_the_chart(tmp_path):
    from eagle3.evaluate.report import plot_speedup
    from eagle3_prefect.flows.report import methods_section
    from eagle3_prefect.tasks.artifacts import method_rows

    result = {**_evaluate_result(), "out": str(tmp_path)}
    plot_speedup(tmp_path / "speedup.png", result["predicted_speedup"], "llama-3.1-8b")
    md = "\n".join(methods_section(method_rows(result), {"evaluate": {"result": result}}))
    for p in result["predicted_speedup"].values():
        assert p["summary"] in md
    assert "speculation does not pay here" in md and "data:image/png;base64," in md


def test_the_summary_splits_a_thinking_targets_acceptance_into_reasoning_and_answer():
    """A thinking target's evaluation (results.json `span_rows`): the run's summary and the
    evaluate artifact show tokens per target step on each span, per method."""
    from eagle3_prefect.tasks.artifacts import span_table

    result = _evaluate_result()
    assert span_table(result) == []  # not split: no table
    result["span_rows"] = [
        {**r, "span": span, "tokens_per_step": tps}
        for r, span, tps in (
            (result["rows"][0], "reasoning", 1.61),
            (result["rows"][0], "answer", 1.22),
            (result["comparisons"][0], "reasoning", 1.05),
            (result["comparisons"][0], "answer", 1.31),
        )
    ]
    table = span_table(result)
    assert "| temperature | span | eagle3 | ngram | prompts |" in table
    assert "| 0 | reasoning | 1.610 | 1.050 | 16 |" in table
    assert "| 0 | answer | 1.220 | 1.310 | 16 |" in table


def test_run_names_put_the_parent_run_in_the_stage_runs():
    from eagle3_prefect.flows.report import run_title
    from eagle3_prefect.tasks.dispatch import child_run_name

    moment = time.mktime((2026, 12, 4, 23, 18, 30, 0, 0, -1))
    assert run_title("demo", moment=moment) == "demo · 2026-12-04 23:18"
    assert run_title("demo", "layer sweep", moment) == "demo · layer sweep · 2026-12-04 23:18"
    parent = "demo · 2026-12-04 23:18"
    assert child_run_name(parent, "demo", "capture") == "demo · 2026-12-04 23:18 › capture"
    assert child_run_name(parent, "demo", "train", 1) == "demo · 2026-12-04 23:18 › train (again 1)"
    sweep = "demo · layer sweep · 2026-12-04 23:18"
    assert child_run_name(sweep, "demo-layers-1-2-3", "train") == f"{sweep} › layers-1-2-3 › train"


def test_deploy_registers_only_the_deployments_of_pools_that_exist():
    from eagle3_prefect.flows.deploy import split_by_pools

    names, skipped = split_by_pools(ROOT / "prefect.yaml", {"cpu", "gpu-1x"})
    assert names[:4] == ["pipeline", "retrain-nightly", "layer-sweep", "streaming"], names
    assert "subflow · train · gpu-1x" in names and not any("gpu-8x" in n for n in names)
    assert sorted(skipped) == ["gpu-8x"] and "subflow · train · gpu-8x" in skipped["gpu-8x"]
