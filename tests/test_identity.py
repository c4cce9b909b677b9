"""No silent wrong results (hostile test of 2026-12-03), on the tiny target and the hf backend:

- the target's identity covers every weight file (eagle3.identity), cached by path, size, mtime and
  inode; train and export refuse a target whose decoder layers differ; capture's resume and its
  "already complete" shortcut refuse changed weights; evaluate refuses a draft made for another
  target (before any engine starts);
- resume compares the new run's inputs with the checkpoint's, naming each field (old -> new), and
  --checkpoint-force-resume applies only to the fields it is safe to change;
- checkpoint hygiene: a checkpoint save killed by SIGKILL leaves temp dirs that resume removes (and
  says so); keep_checkpoints keeps the last N plus the best by validation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.capture import run_capture
from eagle3.config import (
    CaptureConfig,
    ConfigError,
    EvaluateConfig,
    ExportConfig,
    TrainConfig,
    deep_merge,
)
from eagle3.config.train_options import DRAFT_SHAPE_FIELDS, TRAIN_GROUPS, TRAIN_MOVED_KEYS
from eagle3.export import ExportError, run_export
from eagle3.train import run_train
from test_capture import make_prepared

NUM = 12


@pytest.fixture(autouse=True)
def own_cache_dir(tmp_path, monkeypatch):
    """Every test fingerprints with its own hash cache (no state shared through ~/.cache)."""
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(tmp_path / "eagle3-cache"))


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
        shard_tokens=200,
        dtype="float32",
        storage_dtype="float32",
    )
    return CaptureConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def capture(tiny_llama, prepared, tmp_path_factory):
    """A finished hf capture of the tiny target and a 256-token vocab for it."""
    from tests.synthetic_capture import write_vocab

    root = tmp_path_factory.mktemp("cap")
    res = run_capture(_cap_cfg(tiny_llama, prepared, root / "cap"))
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


def _copy_target(src: Path, dst: Path, change: str | None = None) -> Path:
    """A copy of a target dir; `change`: a tensor name whose values are nudged (same shapes, another
    model)."""
    shutil.copytree(src, dst)
    if change:
        f = next(dst.glob("*.safetensors"))
        w = load_file(str(f))
        w[change] = w[change] + 1e-2
        f.unlink()  # a new file, as a fine-tune saved in place writes
        save_file(w, str(f), metadata={"format": "pt"})
    return dst


LAYER = "model.layers.2.mlp.down_proj.weight"


def _log(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------- the fingerprint


def test_fingerprint_covers_every_weight_file_and_is_cached(
    tiny_llama, tmp_path, monkeypatch, capfd
):
    from eagle3 import identity

    a = identity.target_fingerprint(tiny_llama)
    assert a["files"].keys() == {p.name for p in tiny_llama.glob("*.safetensors")}
    assert a["num_bytes"] > 0
    other = _copy_target(tiny_llama, tmp_path / "t", change=LAYER)
    b = identity.target_fingerprint(other)
    assert b["sha256"] != a["sha256"]
    assert identity.describe_difference(a, b).endswith("(target): model.safetensors differs")
    assert identity.describe_difference(a, identity.target_fingerprint(tiny_llama)) is None
    assert identity.target_fingerprint(tmp_path) is None  # no weight files: nothing to compare

    reads, real = [], identity.sha256_file
    monkeypatch.setattr(identity, "sha256_file", lambda p: reads.append(p.name) or real(p))
    assert identity.target_fingerprint(other) == b and reads == []  # cached: path, size, mtime
    w = next(other.glob("*.safetensors"))
    os.utime(w, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns + 1))  # touched: read again
    assert identity.target_fingerprint(other) == b and reads == [w.name]

    monkeypatch.undo()
    monkeypatch.setenv("EAGLE3_CACHE_DIR", str(w))  # a cache dir that cannot be made: a note
    assert identity.target_fingerprint(tiny_llama) == a
    assert "cannot write the target fingerprint cache" in capfd.readouterr().err


# ---------------------------------------------------------------------------------- train, export


def test_train_and_export_refuse_a_target_with_other_decoder_layers(capture, tiny_llama, tmp_path):
    cap, vocab = capture
    layered = _copy_target(tiny_llama, tmp_path / "layered", change=LAYER)
    with pytest.raises(
        ConfigError,
        match=r"captured=.*another target .*weights sha256 \w+\.\.\. "
        r"\(recorded\) != \w+\.\.\. \(target\): "
        r"model.safetensors differs",
    ):
        run_train(_train_cfg(tmp_path / "t", layered, cap, vocab))
    good = run_train(_train_cfg(tmp_path / "good", tiny_llama, cap, vocab, max_steps=2))
    assert (
        good.metadata["target_fingerprint"]["sha256"]
        == json.loads((cap / "manifest.json").read_text())["target_fingerprint"]["sha256"]
    )
    with pytest.raises(ExportError, match=r"checkpoint .* another target .*safetensors differs"):
        run_export(
            ExportConfig(checkpoint=str(good.final_dir), out=tmp_path / "d", target=str(layered))
        )
    assert not (tmp_path / "d").exists()


def _rewrite_config(target: Path, **changes) -> Path:
    """Save the target's config.json again as another library version would: other formatting and
    `changes` applied."""
    p = target / "config.json"
    cfg = {**json.loads(p.read_text()), **changes}
    p.write_text(json.dumps(cfg, indent=4, sort_keys=True))
    return target


def test_a_config_saved_by_another_transformers_version_is_the_same_target(
    capture, tiny_llama, tmp_path
):
    from eagle3.identity import config_sha256
    from eagle3.io import sha256_file

    cap, vocab = capture
    res = run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab, max_steps=2))
    resaved = _rewrite_config(_copy_target(tiny_llama, tmp_path / "v"), transformers_version="0.1")
    assert sha256_file(resaved / "config.json") != sha256_file(tiny_llama / "config.json")
    assert config_sha256(resaved / "config.json") == config_sha256(tiny_llama / "config.json")
    run_export(ExportConfig(checkpoint=str(res.final_dir), out=tmp_path / "d", target=str(resaved)))
    assert (tmp_path / "d" / "model.safetensors").is_file()

    other = _rewrite_config(_copy_target(tiny_llama, tmp_path / "o"), rms_norm_eps=1e-3)
    with pytest.raises(ExportError, match=r"another target .*config.json sha256 \w+ \(recorded\)"):
        run_export(
            ExportConfig(checkpoint=str(res.final_dir), out=tmp_path / "e", target=str(other))
        )
    assert not (tmp_path / "e").exists()

    # a checkpoint from before 2026-12-03 recorded the file's bytes: still the same target, and
    # training resumes from it
    meta_path = tmp_path / "t" / "checkpoints" / "step-2" / "eagle3_draft.json"
    meta = json.loads(meta_path.read_text())
    raw = sha256_file(tiny_llama / "config.json")
    meta["target_config_sha256"] = meta["inputs"]["target_config_sha256"] = raw
    del meta["inputs"]["target_config_file_sha256"]
    meta_path.write_text(json.dumps(meta))
    shutil.rmtree(tmp_path / "t" / "final")
    shutil.rmtree(tmp_path / "t" / "best", ignore_errors=True)
    again = run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab, max_steps=2))
    assert again.steps == 2 and (tmp_path / "t" / "final" / "model.safetensors").is_file()


def test_records_without_the_full_fingerprint_fall_back_with_one_warning(
    capture, tiny_llama, tmp_path, capfd
):
    """A capture written before 2026-12-03 (embedding/norm/lm_head sha256 only): warned once, the
    old fingerprint compared (a permuted lm_head is still refused), never a crash."""
    from eagle3.integrity import FINGERPRINTED, tensor_sha256
    from eagle3.weights import load_target_tensors

    cap, vocab = capture
    old = tmp_path / "old-cap"
    shutil.copytree(cap, old)
    m = json.loads((old / "manifest.json").read_text())
    m.pop("target_fingerprint")
    tensors = load_target_tensors(tiny_llama)
    m["target_weights_sha256"] = {k: tensor_sha256(tensors[k]) for k in FINGERPRINTED}
    (old / "manifest.json").write_text(json.dumps(m))
    permuted = _copy_target(tiny_llama, tmp_path / "perm")
    f = next(permuted.glob("*.safetensors"))
    w = load_file(str(f))
    w["lm_head.weight"][[0, 1]] = w["lm_head.weight"][[1, 0]]
    save_file(w, str(f), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"lm_head weights sha256"):
        run_train(_train_cfg(tmp_path / "t", permuted, old, vocab))
    assert run_train(_train_cfg(tmp_path / "ok", tiny_llama, old, vocab, max_steps=2)).steps == 2
    err = capfd.readouterr().err
    assert err.count("was written before 2026-12-03 and records no fingerprint") == 1


# --------------------------------------------------------------------------------- capture resume


def test_capture_resumed_after_the_weights_changed_is_refused(tiny_llama, prepared, tmp_path):
    from test_capture_resume import kill_capture_after_first_shard

    target = _copy_target(tiny_llama, tmp_path / "target")
    cfg = _cap_cfg(target, prepared, tmp_path / "cap", shard_tokens=60)
    done = kill_capture_after_first_shard(cfg)
    assert done
    shutil.rmtree(target)
    _copy_target(tiny_llama, target, change=LAYER)  # the weight files replaced under the same path
    with pytest.raises(
        ValueError,
        match=r"progress.json: the capture in .* was started with other "
        r"target weights \(weights sha256 .*model.safetensors "
        r"differs\)",
    ):
        run_capture(cfg)
    shutil.rmtree(cfg.out)
    run_capture(cfg)  # finished with the new weights, changed again: "already complete" refused
    shutil.rmtree(target)
    _copy_target(tiny_llama, target)
    with pytest.raises(
        ValueError,
        match=r"manifest.json: this finished capture was made from "
        r"other target weights",
    ):
        run_capture(cfg)


# ------------------------------------------------------------------------------------ regenerate


@pytest.mark.slow
def test_finished_regeneration_from_other_weights_is_refused(tiny_llama, tmp_path):
    """Same path, same settings, other weights: the finished answers are another model's, so the
    "already complete" shortcut refuses them instead of handing them on."""
    from eagle3.config import RegenerateConfig
    from eagle3.data.regenerate import run_regenerate
    from eagle3.testing.tiny import tiny_conversations

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in tiny_conversations(num=2, seed=3)))
    target = _copy_target(tiny_llama, tmp_path / "target")
    cfg = RegenerateConfig(
        target=str(target),
        data=str(data),
        out=tmp_path / "regen",
        backend="hf",
        device="cpu",
        dtype="float32",
        max_new_tokens=4,
        max_model_len=256,
    )
    first = run_regenerate(cfg)
    assert run_regenerate(cfg).num_written == first.num_written  # unchanged: reused
    shutil.rmtree(target)
    _copy_target(tiny_llama, target, change=LAYER)
    with pytest.raises(
        ValueError,
        match=r"regen/manifest.json: these answers were written by "
        r"other target weights \(weights sha256 .*differs\)",
    ):
        run_regenerate(cfg)


# --------------------------------------------------------------------------------------- evaluate


def test_evaluate_refuses_a_draft_made_for_another_target(
    capture, tiny_llama, tmp_path, monkeypatch, capfd
):
    import eagle3.evaluate.run
    import eagle3.vllm_engine
    from eagle3.evaluate import run_evaluate
    from test_evaluate import categorized_prompts

    cap, vocab = capture
    res = run_train(_train_cfg(tmp_path / "t", tiny_llama, cap, vocab, max_steps=2))
    draft = tmp_path / "draft"
    run_export(ExportConfig(checkpoint=str(res.final_dir), out=draft))
    assert json.loads((draft / "eagle3_draft.json").read_text())["target_fingerprint"]["sha256"]

    def engine_started(*a, **k):
        raise RuntimeError("a vLLM engine was started")

    monkeypatch.setattr(eagle3.vllm_engine, "run_in_subprocess", engine_started)
    monkeypatch.setattr(eagle3.evaluate.run, "run_in_subprocess", engine_started)  # its own name
    other = _copy_target(tiny_llama, tmp_path / "other", change="lm_head.weight")
    prompts = categorized_prompts(tmp_path / "p.jsonl")
    cfg = EvaluateConfig(
        target=str(other),
        draft=str(draft),
        prompts=str(prompts),
        out=tmp_path / "eval",
        num_prompts=2,
        max_model_len=256,
    )
    with pytest.raises(
        ConfigError,
        match=rf"draft {draft} was made from another target than "
        rf"target={other}: .*model.safetensors differs.*made "
        r"from \(.*\)",
    ):
        run_evaluate(cfg)
    assert not (tmp_path / "eval").exists()
    # the escape hatch: a warning, then the engines would start
    with pytest.raises(RuntimeError, match="a vLLM engine was started"):
        run_evaluate(cfg.model_copy(update={"allow_target_mismatch": True}))
    assert "warning (allow_target_mismatch=true)" in capfd.readouterr().err


# ----------------------------------------------------------------------------------------- resume


def test_resume_refuses_other_inputs_naming_each_field(capture, tiny_llama, prepared, tmp_path):
    from tests.synthetic_capture import write_vocab

    cap, vocab = capture
    out = tmp_path / "t"
    assert run_train(_train_cfg(out, tiny_llama, cap, vocab), stop_after=2).steps == 2
    cap2 = run_capture(_cap_cfg(tiny_llama, prepared, tmp_path / "cap2", limit=NUM - 2)).out
    vocab2 = write_vocab(tmp_path / "vocab2", 512, torch.arange(1, 512, 2))  # same size, others
    with pytest.raises(ConfigError) as e:
        run_train(
            _train_cfg(
                out, tiny_llama, cap2, vocab2, optimizer={"lr": 2e-3}, loss={"ttt_steps": 3}, seed=1
            )
        )
    msg = str(e.value)
    for part in (
        r"resume from .*step-2: ",
        r"captured \(content\) \w{12}\.\.\. -> \w{12}\.\.\.",
        r"vocab \(d2t/t2d\) \w{12}\.\.\. -> \w{12}\.\.\.",
        r"seed 0 -> 1",
        r"optimizer.lr 0\.001 -> 0\.002",
        r"loss.ttt_steps 2 -> 3",
        r"--checkpoint-force-resume cannot resume .*captured.*vocab.*seed",
        r"a new --out",
    ):
        assert re.search(part, msg), (part, msg)
    with pytest.raises(ConfigError, match="--checkpoint-force-resume cannot resume"):
        run_train(_train_cfg(out, tiny_llama, cap, vocab2, checkpoint={"force_resume": True}))
    assert not (out / "final").exists()


def test_force_resume_applies_the_new_safe_settings(capture, tiny_llama, tmp_path, capfd):
    cap, vocab = capture
    out = tmp_path / "t"
    run_train(_train_cfg(out, tiny_llama, cap, vocab, schedule={"decay": "constant"}), stop_after=2)
    with pytest.raises(
        ConfigError, match=r"optimizer.lr 0\.001 -> 0\.004.*pass --checkpoint-force-resume"
    ):
        run_train(
            _train_cfg(
                out, tiny_llama, cap, vocab, schedule={"decay": "constant"}, optimizer={"lr": 4e-3}
            )
        )
    res = run_train(
        _train_cfg(
            out,
            tiny_llama,
            cap,
            vocab,
            schedule={"decay": "constant"},
            optimizer={"lr": 4e-3},
            checkpoint={"force_resume": True},
        )
    )
    assert res.steps == 4
    assert "warning (checkpoint.force_resume=true): resuming" in capfd.readouterr().err
    lrs = {r["step"]: r["lr"] for r in _log(out) if r["split"] == "train"}
    assert lrs[2] == pytest.approx(1e-3) and lrs[3] == pytest.approx(4e-3), lrs  # not the saved lr


def test_resume_with_another_draft_vocab_size_names_it(capture, tiny_llama, tmp_path):
    from tests.synthetic_capture import write_vocab

    cap, vocab = capture
    out = tmp_path / "t"
    run_train(_train_cfg(out, tiny_llama, cap, vocab), stop_after=2)
    small = write_vocab(tmp_path / "small", 512, torch.arange(0, 200))
    with pytest.raises(ConfigError, match=r"draft_vocab_size 256 -> 200"):
        run_train(_train_cfg(out, tiny_llama, cap, small))


def test_every_train_setting_has_a_resume_rule():
    from eagle3.train.resume_inputs import RESUME_RULES, settings

    # every setting, a group's by its dotted name (the stage's name is not a setting)
    fields = set(settings(TrainConfig().model_dump())) - {"stage"}
    assert set(RESUME_RULES) == fields, fields ^ set(RESUME_RULES)


def test_an_older_flat_checkpoint_record_resumes_in_groups(capture, tiny_llama, tmp_path):
    """A checkpoint written before the settings were grouped records them flat (`lr`,
    `ttt_steps`, EAGLE-3.1 as draft.fc_norm / draft.norm_output): it reads back in groups, so the
    run resumes, and a changed setting is still named."""
    cap, vocab = capture
    out = tmp_path / "t"
    run_train(_train_cfg(out, tiny_llama, cap, vocab), stop_after=2)
    meta_file = out / "checkpoints" / "step-2" / "eagle3_draft.json"
    meta = json.loads(meta_file.read_text())
    grouped = meta["train_config"]
    flat = {k: v for k, v in grouped.items() if k not in TRAIN_GROUPS}
    for old, new in TRAIN_MOVED_KEYS.items():
        group, name = new.split(".")
        flat[old] = grouped[group][name]
    shape = {k: grouped["draft"][k] for k in DRAFT_SHAPE_FIELDS}
    flat["draft"] = {**shape, "fc_norm": False, "norm_output": False}
    assert flat["lr"] == 1e-3 and flat["schedule"] == "cosine" and "optimizer" not in flat
    meta["train_config"] = flat
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"optimizer\.lr 0\.001 -> 0\.004"):
        run_train(_train_cfg(out, tiny_llama, cap, vocab, optimizer={"lr": 4e-3}))
    assert run_train(_train_cfg(out, tiny_llama, cap, vocab)).steps == 4


# ------------------------------------------------------------------------------------ checkpoints

_KILL_WHILE_SAVING = """
import json, os, signal, sys
import eagle3.train.checkpoint as c
from eagle3.config import TrainConfig
from eagle3.train import run_train
save = c._save_weights
def dying_save(model, path):
    if path.parent.name.startswith(".step-4."):  # inside the temp dir of checkpoint step-4
        save(model, path)
        os.kill(os.getpid(), signal.SIGKILL)
    save(model, path)
c._save_weights = dying_save
run_train(TrainConfig.model_validate(json.loads(sys.argv[1])))
"""


def test_checkpoint_temp_files_left_by_a_kill_are_removed_on_resume(
    capture, tiny_llama, tmp_path, capfd
):
    cap, vocab = capture
    cfg = _train_cfg(tmp_path / "t", tiny_llama, cap, vocab, max_steps=6)
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_WHILE_SAVING, json.dumps(cfg.model_dump(mode="json"))],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    ckpts = tmp_path / "t" / "checkpoints"
    stale = [p.name for p in ckpts.iterdir() if p.name.startswith(".")]
    assert stale and all(n.startswith(".step-4.") for n in stale)
    assert not (ckpts / "step-4").exists()
    res = run_train(cfg)
    assert res.steps == 6 and "resumed from" in (err := capfd.readouterr().err)
    assert f"removed {len(stale)} stale temporary checkpoint file(s) left by an interrupted" in err
    assert not [p for p in ckpts.iterdir() if p.name.startswith(".")]


def test_keep_checkpoints_keeps_the_last_ones_and_the_best(capture, tiny_llama, tmp_path):
    cap, vocab = capture
    assert TrainConfig().checkpoint.keep == 3
    out = tmp_path / "t"
    res = run_train(
        _train_cfg(
            out,
            tiny_llama,
            cap,
            vocab,
            max_steps=12,
            optimizer={"lr": 5e-3},
            checkpoint={"keep": 2},
        )
    )
    val = [r for r in _log(out) if r["split"] == "val"]
    best = max(val, key=lambda r: r["tau_estimate"])["step"]  # the first of equals, as best/ is
    kept = {int(p.name.removeprefix("step-")) for p in (out / "checkpoints").glob("step-*")}
    assert kept == {10, 12, best}
    assert res.steps == 12
    run_export(ExportConfig(checkpoint=str(out), out=tmp_path / "d"))  # export still finds best/
    assert (tmp_path / "d" / "model.safetensors").is_file()
    everything = run_train(
        _train_cfg(tmp_path / "all", tiny_llama, cap, vocab, max_steps=8, checkpoint={"keep": 0})
    )
    assert len(list((everything.out / "checkpoints").glob("step-*"))) == 4
