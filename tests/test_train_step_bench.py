"""benchmarks/train_step.py --smoke: the GPU training-step benchmark runs end to end on the CPU at tiny dims,
imports nothing beyond torch/stdlib and the pydantic-free eagle3 modules, and writes its JSON + markdown."""

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
    p = subprocess.run([sys.executable, "-c", RUN, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
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


def test_split_configs_ddp_and_merge(tmp_path):
    """The one-call GPU layout (benchmarks/train_step_gpu.sh) on the CPU: a process per config list, the fast path
    through DDP under torchrun (gloo, 2 ranks), then --merge with the DDP scaling against the 1-process row."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    one, ddp, merged = tmp_path / "one", tmp_path / "ddp", tmp_path / "merged"
    cmd = [sys.executable, "benchmarks/train_step.py", "--smoke", "--budget-s", "120", "--skip-numerics"]
    p = subprocess.run([*cmd, "--label", "P0", "--configs", "fast:3:32", "--out-dir", str(one)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *cmd[1:],
                        "--ddp", "--device", "cpu", "--label", "2xP", "--configs", "fast:3:32", "--out-dir", str(ddp)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads((ddp / "train_step.json").read_text())["configs"]
    assert [(r["name"], r["world"], r["tokens_per_step"], r["status"]) for r in rows] == [
        ("fast K3 32 DDP×2", 2, 64, "ok")]
    p = subprocess.run([*cmd[:2], "--merge", str(one), str(ddp), str(tmp_path / "absent"), "--out-dir", str(merged)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "absent" in p.stderr, p.stderr[-3000:]
    res = json.loads((merged / "train_step.json").read_text())
    assert [r["ran_on"] for r in res["configs"]] == ["P0", "2xP"]
    assert list(res["ddp_scaling"]) == ["fast K3 32 DDP×2"] and res["ddp_scaling"]["fast K3 32 DDP×2"] > 0
    assert "DDP scaling" in (merged / "train_step.md").read_text()
