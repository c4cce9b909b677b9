"""benchmarks/train_step.py --smoke: the GPU training-step benchmark runs end to end on the CPU at
tiny dims, imports nothing beyond torch/stdlib and the pydantic-free eagle3 modules, and writes its
JSON + markdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# pydantic / Prefect / vLLM blocked: the GPU box has none of them
RUN = """
import runpy, sys
for name in ("pydantic", "prefect", "vllm"):
    sys.modules[name] = None
sys.argv = ["benchmarks/train_step.py", "--smoke", "--out-dir", sys.argv[1], "--budget-s", "120"]
runpy.run_path("benchmarks/train_step.py", run_name="__main__")
"""


def test_train_step_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "train_step.json").read_text())
    assert res["smoke"] and res["partial"] is None
    assert res["numerics"]["pass"] is True and res["numerics"]["fp32_pass"] is True
    names = [c["name"] for c in res["configs"]]
    assert any(c["kind"] == "naive" for c in res["configs"]) and len(names) >= 5
    for c in res["configs"]:
        assert c["status"] == "ok", c
        assert c["ms_per_step"] > 0 and c["tokens_per_s"] > 0 and c["mfu"] > 0
    fm = res["flop_model_headline"]
    assert fm["model_flops_per_token"] < fm["model_flops_per_token_unrestricted_target"]
    md = (tmp_path / "train_step.md").read_text()
    assert "Floors" in md and "| fast K7 64 |" in md


def test_flop_model_real_dims():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_step as ts
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    fm = ts.flop_model(ts.REAL, 8192, 7)
    f = fm["forward_per_token"]
    assert f["fc"] == 2 * 3 * 4096 * 4096
    assert f["mlp"] == 7 * 6 * 4096 * 14336
    assert f["attn_core"] == sum(4 * 32 * 128 * (4096 + j) for j in range(7))
    assert fm["model_flops_per_token"] == 3 * sum(f.values()) + 2 * 4096 * 32000
    assert abs(fm["model_flops_per_token"] / 1e9 - 17.697) < 1e-3
    assert ts.bytes_model(ts.REAL, 7)["trainable_params"] == 424_689_664


def test_split_configs_fsdp2_and_merge(tmp_path):
    """The one-call multi-process GPU layout (split --configs per GPU, --ddp, --merge) on the CPU: a
    process per config list, the step through FSDP2 (eagle3.train.parallel.wrap(fsdp=True):
    fully_shard per layer + root; the code path a Kimi-K2.5 draft takes over several GPUs) under
    torchrun (gloo, 2 ranks), then --merge with the scaling against the 1-process row. DDP's
    wrapping is trained through in tests/test_train.py (`eagle3 train` on 2 CPU processes)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    one, ddp, merged = tmp_path / "one", tmp_path / "ddp", tmp_path / "merged"
    cmd = [
        sys.executable,
        "benchmarks/train_step.py",
        "--smoke",
        "--budget-s",
        "120",
        "--skip-numerics",
    ]
    p = subprocess.run(
        [*cmd, "--label", "P0", "--configs", "fast:3:32", "--out-dir", str(one)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            *cmd[1:],
            "--ddp",
            "--fsdp",
            "--device",
            "cpu",
            "--label",
            "2xP",
            "--configs",
            "fast:3:32",
            "--out-dir",
            str(ddp),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((ddp / "train_step.json").read_text())["configs"]
    assert [(r["name"], r["world"], r["parallel"], r["status"]) for r in rows] == [
        ("fast K3 32 FSDP2×2", 2, "fsdp2", "ok")
    ]
    assert rows[0]["tokens_per_s"] > 0 and rows[0]["loss"] > 0 and rows[0]["tokens_per_step"] == 64
    p = subprocess.run(
        [
            *cmd[:2],
            "--merge",
            str(one),
            str(ddp),
            str(tmp_path / "absent"),
            "--out-dir",
            str(merged),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and "absent" in p.stderr, p.stderr[-3000:]
    res = json.loads((merged / "train_step.json").read_text())
    assert [r["ran_on"] for r in res["configs"]] == ["P0", "2xP"]
    assert (
        list(res["ddp_scaling"]) == ["fast K3 32 FSDP2×2"]
        and res["ddp_scaling"]["fast K3 32 FSDP2×2"] > 0
    )
    assert "DDP scaling" in (merged / "train_step.md").read_text()


def test_gpu_step_vs_peer_smoke_and_merge(tmp_path):
    """benchmarks/gpu_step_vs_peer.sh --smoke on the CPU (our side only: the peer harness needs
    CUDA), then the merge with a peer results.json in the layout .peerbench/bench_eagle3.py writes:
    rows in the issue's shape, ratio = ours / peer tokens/s on matching dims + config, peer fields
    null elsewhere, cache phase reported."""
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run(
        [
            "bash",
            "benchmarks/gpu_step_vs_peer.sh",
            "--smoke",
            "--budget-s",
            "200",
            "--out",
            str(out),
            "--no-kimi",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "train_step_vs_peer.json").read_text())
    rows = {(r["dims"], r["config"]): r for r in res["configs"]}
    assert set(rows) == {("smoke:llama-3.1-8b", "K7-T64"), ("smoke:llama-3.1-8b", "K7-T32")}
    for r in rows.values():
        assert (
            r["ours_tok_s"] > 0
            and r["ours_first_step_s"] > 0
            and r["peer_tok_s"] is None
            and r["ratio"] is None
        )
        assert (
            r["command"].startswith("bash benchmarks/gpu_step_vs_peer.sh --smoke")
            and r["gpu"] == "cpu"
        )
    assert (
        "missing" in res["compile_cache_round_trip"]["status"]
    )  # no compiled config on the CPU: no cache file
    assert sorted(x.name for x in out.iterdir()) == sorted(
        [
            "gpu.txt",
            "logs.tgz",
            "ours_llama.json",
            "train_step_vs_peer.json",
            "train_step_vs_peer.md",
        ]
    )

    # the merge against a peer run: our real smoke output relabelled as the Llama dims, the peer's
    # schema
    ours = tmp_path / "ours"
    ours.mkdir()
    mine = json.loads((out / "ours_llama.json").read_text())
    mine["dims_name"] = "llama-3.1-8b"
    (ours / "train_step.json").write_text(json.dumps(mine))
    t64 = next(c for c in mine["configs"] if c["seq"] == 64)
    peer = {
        "env": {"gpu": "cpu"},
        "configs": [
            {
                "T": 64,
                "ttt_steps": 7,
                "median_step_ms": 2 * t64["ms_per_step"],
                "tokens_per_s": t64["tokens_per_s"] / 2,
                "first_step_s_incl_compile": 1.5,
                "peak_mem_GiB": 1.0,
                "MFU_vs_measured_matmul": 0.1,
            },
            {"T": 2048, "ttt_steps": 3, "skipped": "budget"},
        ],
    }
    (tmp_path / "peer.json").write_text(json.dumps(peer))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import step_vs_peer
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    m = step_vs_peer.merge(
        [ours, tmp_path / "nothing-here"], tmp_path / "peer.json", tmp_path / "no-cache", "cmd"
    )
    rows = {(r["dims"], r["config"]): r for r in m["configs"]}
    r = rows[("llama-3.1-8b", "K7-T64")]
    assert abs(r["ratio"] - 2.0) < 1e-9 and r["peer_first_step_s"] == 1.5
    assert r["first_step_ratio"] == r["ours_first_step_s"] / 1.5
    assert rows[("llama-3.1-8b", "K3-T2048")]["ours_status"] == "not run"
    assert rows[("llama-3.1-8b", "K3-T2048")]["peer_status"] == "budget"
    assert (
        any("nothing-here" in x for x in m["missing"])
        and "missing" in m["compile_cache_round_trip"]["status"]
    )
    assert "| llama-3.1-8b | K7-T64 |" in step_vs_peer.markdown(m)
    # a cache-phase process's output (here: the same smoke run standing in for it) -> the round trip
    # + numerics
    m = step_vs_peer.merge([ours], None, ours, "cmd")
    rt = m["compile_cache_round_trip"]
    assert (
        rt["config"] == "K7-T64"
        and rt["first_step_s_cache_loaded"] == t64["first_step_s"] == rt["first_step_s_cold"]
    )
    assert (
        "SAME machine" in rt["note"]
        and "numerics" in m
        and "Compile cache round trip" in step_vs_peer.markdown(m)
    )
