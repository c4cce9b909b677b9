"""benchmarks/peer_quality: our captures -> speculators 0.9.0's training input, checked through its
own loader.

The peer's loader is needed for the check: these tests run where `speculators` 0.9.0 and
`hs_connectors` 0.9.0 import (e.g. `pip install --no-deps --target DIR speculators==0.9.0
hs-connectors==0.9.0` and SPECULATORS_SITE=DIR); elsewhere they are skipped.
"""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if os.environ.get("SPECULATORS_SITE"):
    sys.path.insert(0, os.environ["SPECULATORS_SITE"])
pytest.importorskip(
    "speculators.train.data", reason="speculators 0.9.0 is not importable (SPECULATORS_SITE)"
)


def _module(name: str):
    spec = importlib.util.spec_from_file_location(
        f"peer_quality_{name}", REPO / "benchmarks" / "peer_quality" / f"{name}.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its worker function is pickled by module name
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def captures(tiny_llama, tmp_path_factory) -> str:
    from synthetic_capture import capture_samples, write_captured

    root = tmp_path_factory.mktemp("caps")
    a, man = capture_samples(tiny_llama, num=7, aux_layer_ids=(1, 2, 3), seed=0)
    b, _ = capture_samples(tiny_llama, num=5, aux_layer_ids=(1, 2, 3), seed=1)
    b[2]["loss_mask"] = torch.zeros_like(
        b[2]["loss_mask"]
    )  # nothing supervised: the peer drops such rows
    for s in b:
        s["sample_id"] = "b-" + s["sample_id"]
    write_captured(root / "cap_a", a, man, shard_samples=3)
    write_captured(root / "cap_b", b, man, shard_samples=2)
    return f"{root / 'cap_a'},{root / 'cap_b'}"


def test_the_peers_loader_returns_our_tensors(captures, tmp_path: Path) -> None:
    conv, chk = _module("convert"), _module("check_conversion")
    out = tmp_path / "peer_data"
    rec = conv.convert(captures, out, seed=0, workers=2)
    assert rec["num_rows"] == 11 and rec["num_dropped_unsupervised"] == 1
    assert rec["token_freq"].startswith(
        "speculators."
    )  # the peer's own counter wrote token_freq.pt
    verdict = chk.check(out, num_rows=11)
    assert verdict["equal"], verdict["problems"]
    assert len(verdict["rows_checked"]) == 11
    origins = [(r["capture"].rsplit("/", 1)[-1], r["sample_id"]) for r in verdict["rows_checked"]]
    assert origins != sorted(origins)  # a permutation, not the captures one after the other
    assert {c for c, _ in origins} == {"cap_a", "cap_b"}


def test_the_check_finds_a_wrong_state(captures, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    conv, chk = _module("convert"), _module("check_conversion")
    out = tmp_path / "peer_data"
    conv.convert(captures, out, seed=0, workers=1)
    f = conv.hs_path(out, 3)
    t = load_file(str(f))
    t["hidden_states"][:, [0, 1]] = t["hidden_states"][:, [1, 0]]  # two aux layers swapped
    save_file(t, str(f))
    verdict = chk.check(out, num_rows=11)
    assert not verdict["equal"]
    assert any(p.startswith("row 3 ") and "hidden_states" in p for p in verdict["problems"])


def test_token_freq_counts_the_supervised_tokens(captures, tmp_path: Path) -> None:
    conv = _module("convert")
    out = tmp_path / "peer_data"
    conv.convert(captures, out, seed=0, workers=1)
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    rows = json.loads((out / "conversion.json").read_text())
    assert sum(freq.values()) == rows["num_supervised_tokens"]


def test_a_subset_of_the_captured_layers_in_the_drafts_order(captures, tmp_path: Path) -> None:
    conv, chk = _module("convert"), _module("check_conversion")
    out = tmp_path / "peer_data"
    rec = conv.convert(captures, out, seed=1, workers=1, aux_layer_ids=[3, 1])
    assert rec["aux_layer_ids"] == [3, 1] and rec["aux_positions"] == [2, 0]
    verdict = chk.check(out, num_rows=4)
    assert verdict["equal"], verdict["problems"]
    with pytest.raises(SystemExit, match="not captured"):
        conv.convert(captures, tmp_path / "other", aux_layer_ids=[4])


def test_the_draft_is_the_peers_best_checkpoint_else_its_last_epoch(tmp_path: Path) -> None:
    train = _module("train_peer")
    ckpts = tmp_path / "checkpoints"
    for e in (0, 1, 2):
        (ckpts / str(e)).mkdir(parents=True)
        (ckpts / str(e) / "model.safetensors").write_bytes(b"x")
    (ckpts / "3").mkdir()  # an epoch whose checkpoint was never written (stopped by the budget)
    picked, why = train.pick_checkpoint(ckpts)
    assert picked == ckpts / "2" and why.startswith("last")
    (ckpts / "checkpoint_best").symlink_to("1", target_is_directory=True)
    picked, why = train.pick_checkpoint(ckpts)
    assert picked == (ckpts / "1").resolve() and why.startswith("checkpoint_best")
