"""Integrity under faults: one test per probe of a hostile tester, on the tiny toy target.

Corrupt captures never train or ship (sha256 verified on open and by the "already complete"
shortcut; NaN batches stop training naming shard, sample and step; best/ is finite; export refuses
NaN weights); no code runs from a checkpoint (weights_only); train and export check the target's
identity; one writer per directory; failures are diagnoses, not tracebacks; and the smaller items
(bad UTF-8 line, over-long samples, duplicate captures, bit-exact hf resume, content parts, weight
file modes).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.capture import run_capture
from eagle3.config import CaptureConfig, ConfigError, ExportConfig, TrainConfig, deep_merge
from eagle3.export import ExportError, run_export
from eagle3.shards import load_captured
from eagle3.train import run_train
from test_capture import make_prepared

NUM = 16


@pytest.fixture(scope="module")
def prepared(tiny_llama, tmp_path_factory):
    return make_prepared(tiny_llama, tmp_path_factory.mktemp("prep") / "p", num=NUM, step=9)


def _cap_cfg(target, data, out, **kw):
    base = dict(
        target=str(target),
        data=str(data),
        out=out,
        backend="hf",
        aux_layer_ids=[1, 2, 4],
        device="cpu",
        batch_tokens=30,
        shard_tokens=300,
        dtype="float32",
        storage_dtype="float32",
    )
    return CaptureConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def capture(tiny_llama, prepared, tmp_path_factory):
    """A finished hf capture of the tiny target (several shards) and a vocab for it."""
    from tests.synthetic_capture import write_vocab

    root = tmp_path_factory.mktemp("cap")
    res = run_capture(_cap_cfg(tiny_llama, prepared, root / "cap"))
    assert res.num_shards >= 3
    return res.out, write_vocab(root / "vocab", 512, torch.arange(0, 512, 2))


def _train_cfg(out, target, captured, vocab, **kw):
    base = dict(
        target=str(target),
        captured=str(captured),
        vocab=str(vocab),
        out=out,
        max_steps=4,
        optimizer={"lr": 1e-3},
        schedule={"warmup_steps": 1},
        loader={"max_seq_len": 64, "val_fraction": 0.2},
        loss={"ttt_steps": 2},
        checkpoint={"eval_every": 2, "save_every": 2, "log_every": 1},
        device="cpu",
    )
    return TrainConfig(**deep_merge(base, kw))


def _copy_capture(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".*"))
    return dst


def _flip(shard: Path, mask: int) -> None:
    """XOR `mask` into the high byte (sign + exponent) of every float32 hidden-state value of a
    shard (in place)."""
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    for key in ("aux_hidden_states", "last_hidden_states"):
        assert header[key]["dtype"] == "F32"
        a, b = header[key]["data_offsets"]
        for i in range(8 + n + a + 3, 8 + n + b, 4):
            data[i] ^= mask
    shard.write_bytes(bytes(data))


# ------------------------------------------------------------------------------ 1. corrupt captures


def test_train_refuses_a_capture_whose_shard_fails_sha256(capture, tiny_llama, tmp_path):
    cap, vocab = capture
    bad = _copy_capture(cap, tmp_path / "cap")
    _flip(bad / "shard-00001.safetensors", 0x7F)  # exponent bits: NaN/inf/huge values
    for preload in (False, True):
        with pytest.raises(
            ValueError,
            match=r"differ from the sha256.*\(shard-00001.safetensors\).*`eagle3 capture` again",
        ):
            run_train(
                _train_cfg(
                    tmp_path / f"t{preload}", tiny_llama, bad, vocab, loader={"preload": preload}
                )
            )
    assert (
        not (tmp_path / "tFalse" / "final").exists() and not (tmp_path / "tFalse" / "best").exists()
    )


def test_already_complete_capture_is_verified_and_repaired(
    capture, tiny_llama, prepared, tmp_path, capfd
):
    """Sign bits flipped in a finished capture: "already complete" checks the shards, keeps the good
    ones before the bad one and captures the rest again, bit-identical to the original."""
    cap, _ = capture
    copy = _copy_capture(cap, tmp_path / "cap")
    _flip(copy / "shard-00002.safetensors", 0x80)  # sign bits: finite values, wrong states
    res = run_capture(_cap_cfg(tiny_llama, prepared, copy))
    assert "fail their sha256 (shard-00002.safetensors)" in capfd.readouterr().err
    assert res.resumed_shards == 2 and res.num_samples == NUM
    got, want = list(load_captured(copy, verify=True)), list(load_captured(cap))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a["aux_hidden_states"], b["aux_hidden_states"]), a["sample_id"]
    again = run_capture(_cap_cfg(tiny_llama, prepared, copy))  # intact now: the shortcut
    assert again.capture_s == 0.0 and "sha256-verified" in capfd.readouterr().err


def _nan_capture(cap: Path, out: Path, which: list[int]) -> tuple[Path, list[str]]:
    """A capture written like eagle3's (valid sha256) whose samples `which` hold NaN states: what a
    target that overflowed would record if nothing checked it."""
    from tests.synthetic_capture import write_captured

    from eagle3.artifacts import CaptureManifest

    samples = list(load_captured(cap))
    for i in which:
        samples[i]["aux_hidden_states"] = samples[i]["aux_hidden_states"].clone()
        samples[i]["aux_hidden_states"][3, 1, :5] = float("nan")
    manifest = {
        k: v
        for k, v in CaptureManifest.load(cap).to_dict().items()
        if k not in ("shards", "format", "num_samples")
    }
    return write_captured(out, samples, manifest, shard_samples=5), [
        samples[i]["sample_id"] for i in which
    ]


@pytest.mark.slow
def test_nan_batch_stops_training_naming_shard_sample_and_step(capture, tiny_llama, tmp_path):
    from eagle3.splits import split_indices

    cap, vocab = capture
    train_idx, _ = split_indices(NUM, 0.2, 0)
    path, ids = _nan_capture(cap, tmp_path / "nan", [train_idx[0]])
    with pytest.raises(
        ValueError,
        match=rf"step \d+: .*shard-0000\d.safetensors sample {ids[0]} \(aux_hidden_states "
        r"row 3 .*capture is corrupt",
    ):
        run_train(
            _train_cfg(
                tmp_path / "t",
                tiny_llama,
                path,
                vocab,
                max_steps=12,
                checkpoint={"eval_every": 100},
            )
        )
    assert not (tmp_path / "t" / "final").exists()

    # a tolerance: the bad steps are skipped and counted, the weights stay finite
    res = run_train(
        _train_cfg(
            tmp_path / "t2",
            tiny_llama,
            path,
            vocab,
            max_steps=12,
            optimizer={"max_nonfinite_steps": 5},
            checkpoint={"eval_every": 100},
        )
    )
    assert res.steps == 12
    logs = [
        json.loads(x) for x in (tmp_path / "t2" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    skipped = [r for r in logs if r["split"] == "skipped"]
    assert 1 <= len(skipped) <= 5
    w = load_file(str(res.final_dir / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in w.values())
    state = json.loads(
        (tmp_path / "t2" / "checkpoints" / "step-12" / "trainer_state.json").read_text()
    )
    assert state["num_skipped_steps"] == len(skipped)


def test_a_nan_model_never_becomes_best(capture, tiny_llama, tmp_path, capfd):
    """A validation sample with NaN states gives a NaN validation loss and the do-nothing τ of 1.0,
    which beat the old starting best of -1: best/ must stay unwritten."""
    from eagle3.splits import split_indices

    cap, vocab = capture
    _, val_idx = split_indices(NUM, 0.2, 0)
    path, _ = _nan_capture(cap, tmp_path / "nan", val_idx)
    res = run_train(_train_cfg(tmp_path / "t", tiny_llama, path, vocab))
    assert res.steps == 4 and res.best_dir is None and not (tmp_path / "t" / "best").exists()
    assert "this model cannot become best/" in capfd.readouterr().err


def test_export_refuses_nonfinite_weights(capture, tiny_llama, tmp_path):
    cap, vocab = capture
    res = run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab, max_steps=2))
    w = load_file(str(res.final_dir / "model.safetensors"))
    w["fc.weight"][0, 0] = float("nan")
    save_file(w, str(res.final_dir / "model.safetensors"))
    with pytest.raises(ExportError, match=r"holds NaN/inf in fc.weight.*nothing was written"):
        run_export(ExportConfig(checkpoint=str(res.final_dir), out=tmp_path / "draft"))
    assert not (tmp_path / "draft").exists()


# ------------------------------------------------------------------------------------- 2. no pickle


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_pickle_in_a_checkpoint_is_refused(capture, tiny_llama, tmp_path):
    from eagle3.train.checkpoint import UnsafeCheckpointError

    cap, vocab = capture
    run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab), stop_after=2)
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "t" / "checkpoints" / "step-2"
    for name in ("rng.pt", "optimizer.pt"):
        real = (ckpt / name).read_bytes()
        torch.save({"torch": torch.get_rng_state(), "python": _Payload(str(marker))}, ckpt / name)
        with pytest.raises(UnsafeCheckpointError, match=rf"{name} holds pickled objects.*refused"):
            run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab))
        assert not marker.exists(), "the payload ran"
        (ckpt / name).write_bytes(real)
    assert (
        run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab)).steps == 4
    )  # the real files load


# ---------------------------------------------------------- 5b. fallback to the previous checkpoint


@pytest.mark.slow
def test_unreadable_latest_checkpoint_falls_back_to_the_one_before(
    capture, tiny_llama, tmp_path, capfd
):
    cap, vocab = capture
    kw = dict(max_steps=6, checkpoint={"eval_every": 100})
    straight = run_train(_train_cfg(tmp_path / "a", tiny_llama, cap, vocab, **kw))
    run_train(_train_cfg(tmp_path / "b", tiny_llama, cap, vocab, **kw), stop_after=4)
    latest = tmp_path / "b" / "checkpoints" / "step-4" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:100])  # truncated
    res = run_train(_train_cfg(tmp_path / "b", tiny_llama, cap, vocab, **kw))
    err = capfd.readouterr().err
    assert (
        "checkpoint step-4 is unreadable" in err
        and "truncated or corrupt" in err
        and "resumed from" in err
    )
    assert "step-2 (step 2, written by 1 process(es)" in err
    assert res.steps == 6
    wa, wb = (
        load_file(str(straight.final_dir / "model.safetensors")),
        load_file(str(res.final_dir / "model.safetensors")),
    )
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------------------------------------------- 3. target identity


@pytest.fixture(scope="module")
def permuted_target(tiny_llama, tmp_path_factory):
    """The tiny target with two lm_head rows swapped: same config, same shapes, another model."""
    other = tmp_path_factory.mktemp("other") / "t"
    shutil.copytree(tiny_llama, other)
    f = next(other.glob("*.safetensors"))
    w = load_file(str(f))
    w["lm_head.weight"][[0, 1]] = w["lm_head.weight"][[1, 0]]
    save_file(w, str(f), metadata={"format": "pt"})
    return other


def test_train_and_export_refuse_another_target(
    capture, tiny_llama, permuted_target, tmp_path, capfd
):
    cap, vocab = capture
    manifest = json.loads((cap / "manifest.json").read_text())
    assert manifest["target_fingerprint"]["files"].keys() == {"model.safetensors"}
    with pytest.raises(
        ConfigError,
        match=r"captured=.*another target .*weights sha256 \w+\.\.\. "
        r"\(recorded\) != \w+\.\.\. \(target\): "
        r"model.safetensors differs.*--allow-target-mismatch",
    ):
        run_train(_train_cfg(tmp_path / "t", permuted_target, cap, vocab))
    eps = tmp_path / "eps"
    shutil.copytree(tiny_llama, eps)
    cfg = json.loads((eps / "config.json").read_text())
    (eps / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-5}))
    with pytest.raises(ConfigError, match=r"config.json sha256 \w+ \(recorded\) != \w+ \(target\)"):
        run_train(_train_cfg(tmp_path / "t", eps, cap, vocab))

    res = run_train(
        _train_cfg(
            tmp_path / "ok", permuted_target, cap, vocab, max_steps=2, allow_target_mismatch=True
        )
    )
    assert "warning (allow_target_mismatch=true)" in capfd.readouterr().err
    good = run_train(_train_cfg(tmp_path / "good", tiny_llama, cap, vocab, max_steps=2))
    assert good.metadata["target_fingerprint"] == manifest["target_fingerprint"]
    with pytest.raises(ExportError, match=r"checkpoint .* another target .*safetensors differs"):
        run_export(
            ExportConfig(
                checkpoint=str(good.final_dir), out=tmp_path / "d", target=str(permuted_target)
            )
        )
    assert not (tmp_path / "d").exists()
    run_export(
        ExportConfig(checkpoint=str(res.final_dir), out=tmp_path / "d2", allow_target_mismatch=True)
    )
    assert (tmp_path / "d2" / "config.json").is_file()


# ---------------------------------------------------------------------------- 4. one writer per dir

_HOLD = (
    "import sys, time\nfrom eagle3.lock import dir_lock\n"
    "with dir_lock(sys.argv[1], 'capture out'):\n    print('held', flush=True)\n    "
    "time.sleep(120)\n"
)


def _holder(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_is_refused_naming_the_holder_and_a_dead_holder_is_taken_over(
    capture, tiny_llama, prepared, tmp_path, capfd
):
    from eagle3.lock import LockedError, dir_lock

    out = tmp_path / "cap"
    proc = _holder(out)
    try:
        with pytest.raises(
            LockedError,
            match=rf"capture out {out} is being written by pid {proc.pid} on host "
            rf"{socket.gethostname()}",
        ):
            run_capture(_cap_cfg(tiny_llama, prepared, out, limit=2))
        with pytest.raises(LockedError, match="train out"):
            with dir_lock(tmp_path / "cap", "train out"):
                pass
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # dies holding it: the lock file stays, the flock goes
        proc.wait(timeout=30)
    assert (out / ".eagle3.lock").is_file()
    res = run_capture(_cap_cfg(tiny_llama, prepared, out, limit=2))
    assert res.num_samples == 2
    assert (
        f"taking over the stale lock of capture out {out} left by pid {proc.pid}"
        in capfd.readouterr().err
    )
    assert not (out / ".eagle3.lock").exists(), "released lock file left behind"
    with dir_lock(out, "capture out"), dir_lock(out, "capture out"):  # re-entrant in one process
        assert (out / ".eagle3.lock").is_file()


def test_two_trainings_into_one_out_dir(capture, tiny_llama, tmp_path):
    from eagle3.lock import LockedError

    cap, vocab = capture
    proc = _holder(tmp_path / "t")
    try:
        with pytest.raises(
            LockedError, match=rf"train out {tmp_path / 't'} is being written by pid {proc.pid}"
        ):
            run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


# ------------------------------------------------------------------------- 5. failures as diagnoses


def test_cli_diagnoses_a_truncated_checkpoint_without_traceback(
    capture, tiny_llama, tmp_path, capsys
):
    from eagle3.cli import main

    cap, vocab = capture
    res = run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab, max_steps=2))
    w = res.final_dir / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    assert main(["export", "--checkpoint", str(res.final_dir), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert f"draft checkpoint weights {w} is truncated or corrupt" in err and "Traceback" not in err
    assert (
        main(
            [
                "export",
                "--checkpoint",
                str(res.final_dir),
                "--out",
                str(tmp_path / "d"),
                "--verbose",
            ]
        )
        == 2
    )
    assert "Traceback" in capsys.readouterr().err


def test_disk_full_is_a_diagnosis_naming_the_file(tmp_path):
    """A real ENOSPC (writing /dev/full) inside an atomic write: the error names the file being
    written, and the CLI/Prefect message says what to do."""
    from eagle3.diagnose import describe_failure
    from eagle3.io import atomic_path
    from eagle3_prefect.tasks.errors import classify_exception

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    with pytest.raises(OSError) as info:
        with atomic_path(tmp_path / "shard-00000.safetensors"), open("/dev/full", "wb") as f:
            f.write(b"x" * 65536)
            f.flush()
    msg = describe_failure(info.value)
    assert (
        f"disk full (or quota exceeded) while writing {tmp_path / 'shard-00000.safetensors'}" in msg
    )
    assert "GB free" in msg and "resumes" in msg
    assert (
        classify_exception(info.value) == "config"
    )  # no retry: the disk stays full until someone acts
    assert not list(tmp_path.iterdir()), "temp file left behind"


def test_negative_min_free_disk_is_refused():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="min_free_disk_gb"):
        CaptureConfig(min_free_disk_gb=-1)


# --------------------------------------------------------------------------------- 6. smaller items


def test_bad_utf8_line_is_skipped_and_counted_naming_file_and_line(tiny_llama, tmp_path, caplog):
    from eagle3.chat_formats import read_conversations
    from eagle3.config import PrepareConfig
    from eagle3.data.prepare import run_prepare

    good = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    )
    data = tmp_path / "chats.jsonl"
    data.write_bytes(
        good.encode() + b"\n" + b'{"messages": "\xff\xfe broken"}\n' + good.encode() + b"\n"
    )
    res = read_conversations(data)
    assert len(res.conversations) == 2 and res.skipped == {"invalid_utf8": 1}
    assert "line 2: not valid UTF-8" in res.skip_examples["invalid_utf8"][0]
    assert any(str(data) in r.getMessage() and "line 2" in r.getMessage() for r in caplog.records)
    out = run_prepare(
        PrepareConfig(
            target=str(tiny_llama), data=str(data), out=tmp_path / "prep", max_skipped_fraction=0.5
        )
    )  # 1 of 3 rows skipped
    assert out.num_samples == 2 and out.skipped == {"invalid_utf8": 1}
    bad_json = tmp_path / "chats.json"
    bad_json.write_bytes(b"[\n" + good.encode() + b',\n{"x": "\xff"}\n]')
    with pytest.raises(ValueError, match=rf"{bad_json}: not valid UTF-8 at line 3"):
        read_conversations(bad_json)


def test_samples_longer_than_the_target_are_skipped_and_counted(tiny_llama, prepared, tmp_path):
    from eagle3.capture.inputs import load_capture_inputs

    short = tmp_path / "short"
    shutil.copytree(tiny_llama, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 60}))
    res = run_capture(_cap_cfg(short, prepared, tmp_path / "cap"))
    lengths = [20 + 9 * (k % 12) for k in range(NUM)]
    assert res.num_skipped == {"too_long": sum(n > 60 for n in lengths)}
    assert res.num_samples == sum(n <= 60 for n in lengths)
    assert all(len(s["input_ids"]) <= 60 for s in load_captured(res.out))
    # vLLM: max_model_len is capped at the target's positions, so the engine starts and longer rows
    # are skipped
    ci = load_capture_inputs(_cap_cfg(short, prepared, tmp_path / "v", backend="vllm"))
    assert ci.max_model_len == 60 and ci.length_limit == 60


def test_duplicate_capture_dirs_are_refused(capture, tiny_llama, tmp_path):
    cap, vocab = capture
    with pytest.raises(ConfigError, match="names .* twice"):
        run_train(_train_cfg(tmp_path / "t", tiny_llama, f"{cap},{cap}/", vocab))
    with pytest.raises(ConfigError, match="validation rows would be training rows"):
        run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab, val_captured=str(cap)))


def test_hf_resume_after_sigkill_is_bit_exact_with_multi_sample_batches(tiny_llama, tmp_path):
    """batch_tokens holds several samples per hf batch, so a resumed run that batched from its
    resume point would compute other numbers; it must recompute the chunk the resume point falls
    in."""

    many = make_prepared(tiny_llama, tmp_path / "many", num=40, step=15)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the killed run is single-threaded too: same kernels
    try:
        _resume_bit_exact(
            _cap_cfg(tiny_llama, many, tmp_path / "ref", batch_tokens=400, shard_tokens=250),
            tmp_path,
        )
    finally:
        torch.set_num_threads(threads)


def _resume_bit_exact(cfg: CaptureConfig, tmp_path: Path) -> None:
    from test_capture_resume import kill_capture_after_first_shard

    ref = run_capture(cfg)
    killed = cfg.model_copy(update={"out": tmp_path / "killed"})
    done = kill_capture_after_first_shard(killed)
    assert 1 <= len(done) < ref.num_shards
    res = run_capture(killed)
    assert res.resumed_shards == len(done) and res.num_samples == ref.num_samples
    for a, b in zip(load_captured(killed.out, verify=True), load_captured(ref.out), strict=True):
        for k in ("input_ids", "aux_hidden_states", "last_hidden_states"):
            assert torch.equal(a[k], b[k]), (a["sample_id"], k)
    assert [
        e["sha256"] for e in json.loads((killed.out / "manifest.json").read_text())["shards"]
    ] == [e["sha256"] for e in json.loads((ref.out / "manifest.json").read_text())["shards"]]


def test_chunks_start_where_an_uninterrupted_run_puts_them():
    import numpy as np

    from eagle3.capture.chunks import chunk_start

    lengths = np.array([5, 5, 5, 20, 3, 3, 3, 3])
    # chunks of <= 10 tokens: [0,1] [2] [3] [4,5,6] [7]
    assert [chunk_start(lengths, s, 10) for s in range(9)] == [0, 0, 2, 3, 4, 4, 4, 7, 8]


def test_content_parts_are_joined_with_newlines_as_vllm_renders_them():
    from eagle3.chat_formats import parse_row

    conv, _ = parse_row(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
                },
                {"role": "assistant", "content": "ok"},
            ]
        },
        0,
    )
    assert conv.messages[0]["content"] == "one\ntwo"


def test_weight_files_are_readable_by_other_users(capture, tiny_llama, tmp_path):
    """vLLM serving as another user must read the draft: files 0644 under umask 022, never mkstemp's
    0600."""
    cap, vocab = capture
    old = os.umask(0o022)
    try:
        res = run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab, max_steps=2))
        run_export(ExportConfig(checkpoint=str(res.final_dir), out=tmp_path / "d"))
    finally:
        os.umask(old)
    for f in [
        res.final_dir / "model.safetensors",
        tmp_path / "t" / "checkpoints" / "step-2" / "model.safetensors",
        tmp_path / "d" / "model.safetensors",
        tmp_path / "d" / "config.json",
        cap / "shard-00000.safetensors",
    ]:
        assert f.stat().st_mode & 0o777 == 0o644, (f, oct(f.stat().st_mode))
    for d in (tmp_path / "d", res.final_dir):
        assert d.stat().st_mode & 0o777 == 0o755


def test_lock_waits_for_nothing_and_leaves_nothing(tmp_path):
    """Acquire/release is immediate and removes the lock file (temp-file checks of other tests stay
    valid)."""
    from eagle3.lock import dir_lock

    t0 = time.time()
    with dir_lock(tmp_path / "x", "test dir") as f:
        holder = json.loads(f.read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert time.time() - t0 < 1 and not list((tmp_path / "x").iterdir())
