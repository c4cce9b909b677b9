"""Training over several processes (torchrun, gloo on the CPU): DDP and FSDP2 train what one process
trains, and a checkpoint written at one world size resumes at another (2 -> 1 and 1 -> 2, across
wrappings too).

One process with grad_accum 2 and two processes with grad_accum 1 take the same two packed rows per
step (the loader walks one order; rank r keeps rows r::world), so their losses and weights agree up
to the order of the floating-point sums. The torchrun runs share one launch (a script calling
run_train once per job)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3.config import ConfigError, TrainConfig, deep_merge

ROOT = Path(__file__).resolve().parents[1]
NUM_STEPS = 4

JOBS = """
import json, sys
import torch.distributed as dist
from eagle3.config import TrainConfig
from eagle3.train import run_train

dist.init_process_group("gloo")  # one group for every job (run_train uses it and leaves it)
base = json.loads(sys.argv[1])
for job in json.loads(sys.argv[2]):
    run_train(TrainConfig(**{**base, **job["cfg"]}), stop_after=job.get("stop_after"))
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def capture(tiny_llama, tmp_path_factory):
    from tests.synthetic_capture import capture_samples, frequent_ids, write_captured, write_vocab

    root = tmp_path_factory.mktemp("multi")
    samples, manifest = capture_samples(
        tiny_llama, num=12, aux_layer_ids=(1, 2, 4), min_len=16, max_len=40
    )
    vocab = write_vocab(root / "vocab", 512, frequent_ids(samples, 200, 512))
    return write_captured(root / "cap", samples, manifest, shard_samples=6), vocab


def base_cfg(tiny_llama, capture) -> dict:
    cap, vocab = capture
    return dict(
        target=str(tiny_llama),
        captured=str(cap),
        vocab=str(vocab),
        max_steps=NUM_STEPS,
        optimizer={"lr": 1e-3},
        schedule={"warmup_steps": 1},
        loader={"max_seq_len": 64, "val_fraction": 0.2, "batch_size": 1},
        loss={"ttt_steps": 2},
        checkpoint={"eval_every": 2, "save_every": 2, "log_every": 1},
        device="cpu",
    )


def train_losses(out: Path) -> list[float]:
    rows = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r["split"] == "train"]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final" / "model.safetensors"))


def assert_same_training(got: Path, want: Path) -> None:
    lg, lw = train_losses(got), train_losses(want)
    assert len(lg) == len(lw) == NUM_STEPS, (lg, lw)
    torch.testing.assert_close(torch.tensor(lg), torch.tensor(lw), rtol=1e-5, atol=1e-6)
    wg, ww = final_weights(got), final_weights(want)
    assert wg.keys() == ww.keys()
    for k in ww:
        torch.testing.assert_close(wg[k], ww[k], rtol=1e-4, atol=1e-5, msg=f"{got.name}: {k}")


def torchrun(base: dict, jobs: list[dict], tmp: Path, timeout_s: float = 300) -> tuple[int, str]:
    """(exit code, stderr) of the jobs under torchrun on 2 CPU processes; the whole process group is
    killed on timeout (no rank left behind)."""
    script = tmp / "jobs.py"
    script.write_text(JOBS)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]), OMP_NUM_THREADS="1"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(script),
            json.dumps(base),
            json.dumps(jobs),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        pytest.fail(f"torchrun jobs did not finish in {timeout_s} s: {err[-3000:]}")
    return proc.returncode, err


@pytest.mark.slow
def test_ddp_and_fsdp2_match_one_process_and_resume_across_world_sizes(
    tiny_llama, capture, tmp_path
):
    from eagle3.train import run_train

    base = base_cfg(tiny_llama, capture)
    one = dict(
        loader={"grad_accum": 2},
    )  # one process, two micro-batches: the rows two processes take in one step each
    ref = tmp_path / "one"
    run_train(TrainConfig(**deep_merge(base, one), out=ref))
    run_train(
        TrainConfig(**deep_merge(base, one), out=tmp_path / "w1to2"), stop_after=2
    )  # resumed by 2 processes below

    jobs = [
        {"cfg": {"out": str(tmp_path / "ddp"), "runtime": {"parallel": "ddp"}}},
        {"cfg": {"out": str(tmp_path / "fsdp2"), "runtime": {"parallel": "fsdp2"}}},
        {
            "cfg": {"out": str(tmp_path / "w2to1"), "runtime": {"parallel": "fsdp2"}},
            "stop_after": 2,
        },
        {"cfg": {"out": str(tmp_path / "w1to2"), "runtime": {"parallel": "ddp"}}},
    ]
    rc, err = torchrun(base, jobs, tmp_path)
    assert rc == 0, err[-4000:]
    assert "2 processes: ddp (train.runtime.parallel ddp)" in err and "2 processes: fsdp2" in err
    assert "written by 1 process(es), none" in err  # w1to2 resumed at world 2

    st = json.loads(
        (tmp_path / "w2to1" / "checkpoints" / "step-2" / "trainer_state.json").read_text()
    )
    assert (st["world_size"], st["parallel"], st["global_batch_rows"]) == (2, "fsdp2", 2)
    assert not (
        tmp_path / "w2to1" / "checkpoints" / "step-2" / "optimizer"
    ).exists()  # one full optimizer file
    with pytest.raises(
        ConfigError, match=r"2 packed rows per optimizer step .* set loader.grad_accum: 2"
    ):
        run_train(
            TrainConfig(**base, out=tmp_path / "w2to1")
        )  # grad_accum 1 in one process: half the rows
    run_train(TrainConfig(**deep_merge(base, one), out=tmp_path / "w2to1"))  # FSDP2 2 -> 1

    for name in ("ddp", "fsdp2", "w2to1", "w1to2"):
        assert_same_training(tmp_path / name, ref)


def test_full_optimizer_state_round_trip_and_shape_check():
    """One process: the saved optimizer state is the optimizer's own dict on the CPU and loads back;
    a state of another shape is refused naming the parameter."""
    from eagle3.train import parallel

    d = parallel.Dist()
    w = torch.nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.grad = torch.ones(3, 4)
    opt.step()
    sd = parallel.full_optimizer_state(opt, d)
    assert torch.equal(sd["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    w2 = torch.nn.Parameter(torch.zeros(3, 4))
    opt2 = torch.optim.AdamW([w2], lr=0.1)
    parallel.load_full_optimizer_state(opt2, sd, "ckpt/optimizer.pt")
    assert torch.equal(opt2.state[w2]["exp_avg_sq"], opt.state[w]["exp_avg_sq"])
    bad = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4, 3))], lr=0.1)
    with pytest.raises(ValueError, match=r"ckpt/optimizer.pt: parameter 0 exp_avg: shape \(3, 4\)"):
        parallel.load_full_optimizer_state(bad, sd, "ckpt/optimizer.pt")


def test_parallel_choice():
    from eagle3.train import parallel

    model = torch.nn.Linear(4, 4)
    one, two = parallel.Dist(), parallel.Dist(rank=0, world=2)
    assert parallel.choose_parallel("fsdp2", model, one) == "none"
    assert [parallel.choose_parallel(w, model, two) for w in ("auto", "ddp", "fsdp2", "fsdp")] == [
        "ddp",
        "ddp",
        "fsdp2",
        "fsdp2",
    ]
    assert (
        TrainConfig(runtime={"parallel": "fsdp"}).runtime.parallel == "fsdp2"
        and TrainConfig().runtime.parallel == "auto"
    )
