"""What `eagle3` prints: quiet defaults that never override the user's environment, the per-stage
line, the summary table, and the n-gram vs draft comparison (tokens per target step, not only vLLM's
τ)."""

from __future__ import annotations

import json
import logging

import pytest

from eagle3.console import (
    QUIET_ENV,
    StageLine,
    compare_methods,
    configure_output,
    format_summary,
    key_figure,
    summary_rows,
    tokens_per_target_step,
)
from eagle3_prefect.tasks.subprocess_runner import _WARNING_RE


@pytest.fixture
def clean_env(monkeypatch):
    for k in QUIET_ENV:
        monkeypatch.delenv(k, raising=False)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield monkeypatch
    root.handlers[:] = handlers
    root.setLevel(level)


def test_quiet_defaults_never_override_the_environment(clean_env):
    import os

    clean_env.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    configure_output(verbose=False)
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"  # the user's choice wins
    assert os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] == "WARNING"
    assert logging.getLogger().level == logging.WARNING


def test_verbose_sets_nothing_quiet(clean_env):
    import os

    configure_output(verbose=True)
    assert not any(k in os.environ for k in QUIET_ENV)
    assert logging.getLogger().level == logging.INFO


def test_stage_line_and_failure(caplog):
    log = logging.getLogger("eagle3.progress")
    log.addHandler(caplog.handler)
    try:
        with StageLine("prepare", 2, 7) as line:
            line.done({"num_samples": 192, "num_tokens": 25865}, cached=False, wall_s=4.2)
        with pytest.raises(RuntimeError), StageLine("capture", 3, 7):
            raise RuntimeError("boom")
    finally:
        log.removeHandler(caplog.handler)
    text = caplog.text
    assert (
        "[2/7] prepare" in text
        and "ran" in text
        and "4.2 s" in text
        and "192 rows, 25,865 tokens" in text
    )
    assert "[3/7] capture" in text and "failed after" in text


def test_summary_table_from_flow_manifests(tmp_path):
    manifests = {
        "prepare": {
            "stage": "prepare",
            "cached": True,
            "wall_s": 3.0,
            "result": {"num_samples": 64, "num_tokens": 9419},
        },
        "capture": {
            "stage": "capture",
            "cached": False,
            "wall_s": 41.5,
            "result": {"num_tokens": 9419, "tokens_per_s": 812.3},
        },
        "evaluate": {
            "stage": "evaluate",
            "cached": False,
            "wall_s": 90.0,
            "result": {
                "acceptance_length": 1.8,
                "spec_tokens_per_s": 60.0,
                "baseline_tokens_per_s": 70.0,
                "rows": [{"category": "all", "generated_tokens": 1000, "num_accepted_tokens": 400}],
            },
        },
    }
    text = format_summary(
        "demo", summary_rows(manifests), tmp_path, {"details": "x/run_summary.json"}
    )
    assert "3 stages, 2 ran, 1 cached" in text
    lines = {ln.split()[0]: ln for ln in text.splitlines() if ln.startswith("  ") and ln.split()}
    assert (
        "cached" in lines["prepare"] and "-" in lines["prepare"]
    )  # a cached stage took no time now
    assert "41.5s" in lines["capture"] and "812 tokens/s" in lines["capture"]
    assert "τ 1.80" in lines["evaluate"] and "1.67 tokens/target step" in lines["evaluate"]
    assert "131.5s" in lines["total"] and "run_summary.json" in text


def test_tokens_per_target_step_counts_steps_without_drafts(tmp_path):
    # n-gram drafted on 520 steps and had 926 tokens accepted: vLLM's τ is 2.78, but over all 2,382
    # target steps of 3,308 generated tokens it is 1.39 (measured 2026-12-01 on SmolLM2, 32 prompts)
    assert tokens_per_target_step(3308, 926) == pytest.approx(1.389, abs=1e-3)
    for method, drafts, acc in (("eagle3", 1900, 800), ("ngram", 520, 926)):
        (tmp_path / method).mkdir()
        (tmp_path / method / "results.json").write_text(
            json.dumps(
                {
                    "method": method,
                    "acceptance_length": 1 + acc / drafts,
                    "num_drafts": drafts,
                    "rows": [
                        {
                            "category": "all",
                            "generated_tokens": 3308 if method == "ngram" else 2700,
                            "num_accepted_tokens": acc,
                            "num_drafts": drafts,
                            "tokens_per_s": 50.0,
                        }
                    ],
                }
            )
        )
    text = compare_methods([tmp_path / "eagle3", tmp_path / "ngram" / "results.json"])
    ngram = next(ln for ln in text.splitlines() if "ngram" in ln)
    assert "2.78" in ngram and "1.39" in ngram and "22%" in ngram
    assert "1.42" in next(ln for ln in text.splitlines() if "eagle3" in ln)


def test_one_results_dir_with_comparisons_prints_every_method(tmp_path):
    """evaluate with `compare: [ngram]` writes one results.json: the draft's `rows`, n-gram's
    `comparisons`."""

    def row(method, category, temperature, gen, acc, drafts, tau):
        return {
            "method": method,
            "category": category,
            "temperature": temperature,
            "generated_tokens": gen,
            "num_accepted_tokens": acc,
            "num_drafts": drafts,
            "tau": tau,
            "tokens_per_s": 60.0,
        }

    (tmp_path / "evaluate").mkdir()
    result = {
        "method": "eagle3",
        "acceptance_length": 1.42,
        "num_drafts": 1900,
        "spec_tokens_per_s": 60.0,
        "rows": [
            row("eagle3", "all", 0.0, 2700, 800, 1900, 1.42),
            row("eagle3", "all", 0.6, 2600, 700, 1800, 1.39),
        ],
        "comparisons": [
            row("ngram", "chat", 0.0, 1000, 300, 100, 4.0),
            row("ngram", "all", 0.0, 3308, 926, 520, 2.78),
            row("ngram", "all", 0.6, 3000, 500, 400, 2.25),
        ],
    }
    (tmp_path / "evaluate" / "results.json").write_text(json.dumps(result))
    lines = compare_methods([tmp_path / "evaluate"]).splitlines()
    assert [ln.split()[0] for ln in lines[1:]] == [
        "eagle3",
        "ngram",
    ]  # each method's first-temperature "all" row
    assert lines[2].split()[1:4] == ["2.78", "1.39", "22%"]
    fig = key_figure("evaluate", result)
    assert (
        fig.startswith("τ 1.42, 1.42 tokens/target step")
        and "| ngram τ 2.78, 1.39 tokens/target step" in fig
    )


def test_key_figures_name_what_each_stage_did():
    assert (
        key_figure("regenerate", {"num_written": 192, "generated_tokens": 20000})
        == "192 conversations, 20,000 tokens generated"
    )
    assert "coverage 0.987" in key_figure("vocab", {"draft_vocab_size": 4096, "coverage": 0.987})
    assert (
        key_figure("train", {"steps": 110, "train_loss": 7.1, "val_metrics": {"acc_0": 0.43}})
        == "110 steps, loss 7.100, val acc@1 0.430"
    )
    assert key_figure("export", {"format": "vllm"}) == "vllm draft"
    assert key_figure("unknown-stage", {}) == ""
    assert (
        key_figure(
            "fetch-target",
            {"name": "smollm2-135m-instruct", "dtype": "bfloat16", "reused": True, "out": "runs/t"},
        )
        == "smollm2-135m-instruct (bfloat16) reused at runs/t"
    )


def test_child_warnings_stay_visible():
    """tasks/_stage_main.py logs as 'LEVEL name: message'; the parent copies WARNING+ lines at
    WARNING."""
    assert _WARNING_RE.match(
        "WARNING eagle3.data.regenerate: skipped 3 prompts longer than max_model_len"
    )
    assert _WARNING_RE.match("ERROR eagle3.capture.run: shard 3 failed")
    assert not _WARNING_RE.match("INFO eagle3.train: step 10/80")
    assert not _WARNING_RE.match(
        "(EngineCore pid=1) WARNING 12-01 13:29:18 [cpu.py:224] Triton is not installed."
    )
