"""`eagle3 plan`: bytes/token and storage for the config-only Kimi-K2.5 shape, fp8 halving, the
measured anchors, the mode decision, the capture's refusal on a too-small disk, the CLI, and
docs/scaling.md's figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.flops import count_target_forward_flops, count_target_params
from eagle3.plan import (
    HARDWARE,
    REFBENCH_TARGET,
    PlanConfig,
    format_plan,
    load_anchors,
    run_plan,
)
from eagle3.shards import check_capture_fits, estimate_storage

ROOT = Path(__file__).resolve().parents[1]
KIMI = dict(
    config=str(ROOT / "configs/kimi-k2.5.yaml"),
    target_config=str(ROOT / "configs/targets/kimi-k2.5.json"),
)


def test_kimi_k25_bytes_per_token_and_fp8_halves_it():
    r = run_plan(PlanConfig(**KIMI, num_samples=1000, mean_tokens=1000, storage_dtype="bfloat16"))
    st = r.storage
    assert (
        r.aux_layer_ids == [2, 30, 58] and st.hidden_size == 7168
    )  # read from the nested text_config
    assert (
        st.state_bytes_per_token == 4 * 7168 * 2 == 57_344
    )  # the "~56 KiB for 4 captured layers"
    assert st.bytes_per_token == 57_344 + 8 + 1  # + int64 token id + int8 loss mask
    assert st.total_bytes == 1000 * 1000 * st.bytes_per_token == r.storage_bf16_bytes
    f8 = run_plan(
        PlanConfig(**KIMI, num_samples=1000, mean_tokens=1000, storage_dtype="fp8")
    ).storage
    assert f8.state_bytes_per_token == 28_672
    assert f8.bytes_per_token == 28_672 + 4 * 4 + 9  # + one float32 scale per layer
    assert 0.5 < f8.total_bytes / st.total_bytes < 0.5005


def test_target_counts_match_published_sizes():
    """Total / active parameters from the config-only shapes agree with the model cards (1.04T/32B,
    671B/37B, ...)."""

    def params(name):
        c = json.loads((ROOT / "configs/targets" / f"{name}.json").read_text())
        return count_target_params(c.get("text_config") or c)

    kimi, ds, qwen = params("kimi-k2.5"), params("deepseek-v3"), params("qwen3-30b-a3b")
    assert 1.00e12 < kimi["total"] < 1.06e12 and 31e9 < kimi["active_per_token"] < 33.5e9
    assert 665e9 < ds["total"] < 675e9 and 36e9 < ds["active_per_token"] < 38e9
    assert 30e9 < qwen["total"] < 31e9 and 2.9e9 < qwen["active_per_token"] < 3.4e9
    assert 8.0e9 < params("llama-3.1-8b")["total"] < 8.1e9
    # longer prompts cost more attention, same weights
    tc = json.loads((ROOT / "configs/targets/llama-3.1-8b.json").read_text())
    a, b = count_target_forward_flops(tc, 1000), count_target_forward_flops(tc, 4000)
    assert a["weights"] == b["weights"] and b["attention_core"] == 4 * a["attention_core"]


def test_estimates_scale_from_the_measured_figures():
    anchors = load_anchors(ROOT / "benchmarks/results", "bfloat16")
    cap = json.loads((ROOT / "benchmarks/results/capture_throughput.json").read_text())
    assert (
        anchors["capture"]["tokens_per_s"]
        == cap["per_storage_dtype"]["bfloat16"]["capture_tokens_per_s"]
    )
    r = run_plan(PlanConfig(**KIMI, num_samples=10_000, mean_tokens=1500, hardware="h200"))
    # training on the H200 profile = measured tokens/s x FLOP ratio x GPUs (ratio 1 to itself)
    tr = anchors["train"]
    want = 8 * tr["tokens_per_s"] * tr["flops_per_token"] / r.draft_flops_per_token
    assert r.train.tokens_per_s == pytest.approx(want)
    b300 = run_plan(PlanConfig(**KIMI, num_samples=10_000, mean_tokens=1500, hardware="b300"))
    assert b300.train.tokens_per_s / r.train.tokens_per_s == pytest.approx(2250 / 989.4)
    assert b300.train.gpu_hours < r.train.gpu_hours and b300.capture.hours < r.capture.hours
    # the CPU profile is the measured CPU rate, FLOP-scaled: the refbench target itself gives it
    # back
    assert anchors["capture"]["achieved_flops"] / count_target_forward_flops(
        REFBENCH_TARGET, anchors["capture"]["mean_prompt_tokens"]
    )["total"] == pytest.approx(anchors["capture"]["tokens_per_s"], rel=1e-3)


def test_refbench_target_shape_matches_the_measured_target(refbench):
    c = json.loads((refbench / "target-a-llama" / "config.json").read_text())
    assert {k: c.get(k) for k in REFBENCH_TARGET} == REFBENCH_TARGET


def test_mode_offline_vs_streaming_and_spool_cap():
    small = run_plan(PlanConfig(**KIMI, num_samples=10_000, mean_tokens=1500, hardware="b300"))
    assert small.mode == "offline" and small.spool_cap_bytes is None
    big = run_plan(PlanConfig(**KIMI, num_samples=1_400_000, mean_tokens=1500, hardware="b300"))
    assert big.mode == "streaming" and big.storage.total_bytes > 100e12  # the ">100 TB"
    assert 0 < big.spool_cap_bytes <= (big.disk_bytes - big.disk_reserve_bytes) / 2
    # a disk that holds the fp8 capture but not the bf16 one: the reason says so
    mid = run_plan(
        PlanConfig(**KIMI, num_samples=100_000, mean_tokens=1500, hardware="b300", disk_tb=5)
    )
    assert (
        mid.mode == "streaming"
        and "fp8" in mid.mode_reason
        and "would fit offline" in mid.mode_reason
    )


def test_dataset_size_from_prepared_manifest_or_a_named_error(tmp_path):
    from eagle3.config import ConfigError
    from eagle3.io import write_json

    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        f"target: {ROOT / 'configs/targets/kimi-k2.5.json'}\ndata: x.jsonl\nwork_dir: "
        f"{tmp_path / 'w'}\n"
    )
    with pytest.raises(ConfigError, match="--num-samples"):
        run_plan(PlanConfig(config=str(cfg)))
    write_json(
        tmp_path / "w" / "prepared" / "manifest.json", {"num_samples": 40, "num_tokens": 4000}
    )
    r = run_plan(PlanConfig(config=str(cfg), hardware="cpu"))
    assert (r.num_samples, r.mean_tokens) == (40, 100.0) and "manifest" in r.sample_source
    assert r.disk_bytes > 0 and "measured" in r.hardware["disk_source"]


def test_capture_refuses_a_disk_too_small_naming_numbers_and_fixes(tmp_path):
    est = estimate_storage(3, 7168, "bfloat16", 2_000_000)  # 114.7 GB
    free = check_capture_fits(tmp_path, estimate_storage(3, 128, "bfloat16", 10), 0.0)
    assert free > 0
    huge = estimate_storage(3, 7168, "bfloat16", int(2 * free / est.bytes_per_token) + 10)
    lengths = [1000] * (huge.num_tokens // 1000)
    with pytest.raises(ValueError) as e:
        check_capture_fits(tmp_path / "new" / "out", huge, 1.0, lengths)
    msg = str(e.value)
    assert (
        f"{huge.num_tokens:,} tokens x 57,353 bytes/token" in msg
        and "min_free_disk_gb = 1.0 GB" in msg
    )
    assert (
        "--storage-dtype fp8" in msg and "does not fit either" in msg
    )  # 2x the free space: fp8 is ~1x
    assert "streaming" in msg and "--limit " in msg
    n_fit = int(msg.split("--limit ")[1].split(" ")[0])
    assert 0 < n_fit < len(lengths) and (n_fit + 1) * 1000 * huge.bytes_per_token > free - 1024**3


def test_capture_stage_refuses_before_writing(tiny_llama, tmp_path):
    """run_capture itself goes through the planner's check (and names the fp8 alternative)."""
    from eagle3.capture import run_capture
    from eagle3.config import CaptureConfig
    from test_capture import make_prepared

    prep = make_prepared(tiny_llama, tmp_path / "prep", num=3)
    cfg = CaptureConfig(
        target=str(tiny_llama),
        data=str(prep),
        out=tmp_path / "o",
        backend="hf",
        aux_layer_ids=[1, 2, 4],
        min_free_disk_gb=1e9,
    )
    with pytest.raises(
        ValueError,
        match=r"bytes/token: 3 aux \+ 1 last layer x H=128 in bfloat16.*--storage-dtype fp8",
    ):
        run_capture(cfg)
    assert not list((tmp_path / "o").glob("shard-*"))


def test_cli_table_and_json(capsys):
    """The `eagle3 plan` command line, through the CLI's main() in this process (the entry point's
    code path without a Python + torch start-up per call)."""
    from eagle3.cli import main

    base = [
        "plan",
        "--config",
        KIMI["config"],
        "--target-config",
        KIMI["target_config"],
        "--num-samples",
        "10000",
        "--mean-tokens",
        "1500",
        "--hardware",
        "rtx-pro-6000",
    ]
    assert main(base) == 0
    out = capsys.readouterr()
    assert (
        "57,353 B (57,344 B states = 56.0 KiB" in out.out
        and "mode" in out.out
        and "GPU-h" in out.out
    ), out.err
    assert main(base + ["--format", "json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["storage"]["bytes_per_token"] == 57_353 and res["hardware"]["name"] == "rtx-pro-6000"
    assert (
        res["mode"] in ("offline", "streaming")
        and res["capture"]["hours"] > 0
        and res["train"]["gpu_hours"] > 0
    )
    assert (
        main(
            base[:3]
            + [
                "--target-config",
                "/nonexistent/config.json",
                "--num-samples",
                "1",
                "--mean-tokens",
                "1",
            ]
        )
        == 2
    )
    assert "--target-config" in capsys.readouterr().err


def test_every_profile_says_where_its_numbers_come_from():
    for hw in HARDWARE.values():
        assert hw.sources.get("disk_tb") and (
            hw.bf16_tflops is None or hw.sources.get("bf16_tflops")
        ), hw.name
    assert set(HARDWARE) == set(PlanConfig.model_fields["hardware"].annotation.__args__)
    r = run_plan(PlanConfig(**KIMI, num_samples=10, mean_tokens=10, hardware="cpu"))
    assert "cpu" in format_plan(r)


def test_scaling_doc_figures_come_from_the_command():
    """docs/scaling.md pastes `eagle3 plan` output; regenerate it with `python
    scripts/scaling_plans.py --write`."""
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts/scaling_plans.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]


def test_measured_figures_ship_as_package_data():
    """plan reads its anchors from eagle3/assets/measured (declared package data), not a path into
    the checkout; the shipped copies are the repository's latest measurements."""
    import tomllib

    from eagle3.plan import RESULTS_DIR

    assert (
        RESULTS_DIR.parent.name == "assets" and RESULTS_DIR.parent.parent == ROOT / "src" / "eagle3"
    )
    for name in ("capture_throughput.json", "train_step.json"):
        assert json.loads((RESULTS_DIR / name).read_text()) == json.loads(
            (ROOT / "benchmarks/results" / name).read_text()
        ), (
            f"benchmarks/results/{name} was re-measured: copy it to "
            f"src/eagle3/assets/measured/{name}"
        )
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert (
        "eagle3.assets.measured" in setup["packages"]
        and "*" in setup["package-data"]["eagle3.assets.measured"]
    )


def test_plan_predicts_speedups_from_an_evaluation(tmp_path):
    """`eagle3 plan --hardware H` after `eagle3 evaluate`: every measured method's speed-up per k
    and concurrency on H, from results.json's counters (n-gram: no draft to read)."""
    from eagle3.io import write_json
    from eagle3.step_time import UNIFORM_ROUTING

    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        f"target: {ROOT / 'configs/targets/kimi-k2.5.json'}\ndata: x.jsonl\nwork_dir: "
        f"{tmp_path / 'w'}\n"
    )
    row = {
        "method": "ngram",
        "category": "all",
        "temperature": 0.0,
        "num_prompts": 8,
        "num_drafts": 300,
        "num_accepted_tokens": 150,
        "accepted_per_position": [90, 40, 20],
        "generated_tokens": 1024,
    }
    write_json(
        tmp_path / "w" / "evaluate" / "results.json",
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "rows": [row],
            "speculative_run": {"metrics": {"vllm:prompt_tokens": 4000}},
            "config": {"method": "ngram"},
        },
    )
    r = run_plan(
        PlanConfig(config=str(cfg), hardware="rtx-pro-6000", num_samples=1000, mean_tokens=1000)
    )
    p = r.predicted_speedup["ngram"]
    assert p["context_len"] == (4000 + 1024 / 2) / 8
    assert p["tensor_parallel_size"] == 8 and p["routing_source"] == UNIFORM_ROUTING
    # 300 of the 1024 - 150 - 8 decode passes drafted
    assert p["drafted_fraction"] == pytest.approx(300 / 866)
    assert p["measured_rates"] == pytest.approx([0.3, 40 / 300, 20 / 300])
    text = format_plan(r)
    assert "speculation (ngram)" in text and p["summary"] in text
    assert "Predicted speed-up over no speculation, ngram on rtx-pro-6000" in text
