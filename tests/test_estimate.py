"""Checkpoint selection and offline τ: replayed rounds, layer subsets, RAM preload, prefetching,
padded eval."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eagle3.config import TrainConfig
from eagle3.train.data import (
    PackedLoader,
    SelectedLayers,
    collate,
    eval_batches,
    pack,
    pack_batch,
    preload_samples,
)
from eagle3.train.estimate import EstimateConfig, estimate_acceptance, replay_rounds, score_batches
from eagle3.train.step import TTTModule


@pytest.fixture(scope="module")
def captured(tiny_llama, tmp_path_factory):
    from tests.synthetic_capture import capture_samples, frequent_ids, write_captured, write_vocab

    samples, manifest = capture_samples(
        tiny_llama, num=14, aux_layer_ids=(1, 2, 3), min_len=16, max_len=40
    )
    tmp = tmp_path_factory.mktemp("est")
    vocab = write_vocab(tmp / "vocab", 512, frequent_ids(samples, 200, 512))
    return samples, manifest, vocab, write_captured(tmp / "cap", samples, manifest, shard_samples=5)


def test_replay_rounds_counts_like_the_engine():
    # one document, supervised rows 2..11; k = 3. Rounds start one row after the first supervised
    # row.
    K, T = 3, 16
    doc = torch.zeros(1, T, dtype=torch.long)
    valid = torch.zeros(K, 1, T, dtype=torch.bool)
    valid[:, 0, 2:12] = True
    correct = torch.zeros(K, 1, T, dtype=torch.bool)
    correct[:, 0, 3] = True  # round at row 3 accepts 3 -> next round at row 7
    correct[0, 0, 7] = True  # round at row 7 accepts 1 (step 1 wrong) -> row 9
    correct[1:, 0, 9] = True  # round at row 9: step 0 wrong -> accepts 0 -> row 10, then 11
    r = replay_rounds(correct, valid, doc, k=3)
    assert r.num_rounds == 5 and r.accepted_per_position == [2, 1, 1]
    assert r.tau == pytest.approx(1 + 4 / 5)
    # 5 tokens: the first answer token, then 3 accepted + the bonus at row 3 -> done before row 7
    assert replay_rounds(correct, valid, doc, k=3, max_new_tokens=5).num_rounds == 1


def test_selected_layers_reads_the_last_layer_as_id_L(captured):
    samples, manifest, _, path = captured
    sel = SelectedLayers(samples, manifest["aux_layer_ids"], [3, 5, 1], num_hidden_layers=5)
    s, raw = sel[2], samples[2]
    assert torch.equal(
        s["aux_hidden_states"][:, 0], torch.as_tensor(raw["aux_hidden_states"])[:, 2]
    )
    assert torch.equal(s["aux_hidden_states"][:, 1], torch.as_tensor(raw["last_hidden_states"]))
    assert torch.equal(
        s["aux_hidden_states"][:, 2], torch.as_tensor(raw["aux_hidden_states"])[:, 0]
    )
    with pytest.raises(
        ValueError, match=r"TrainConfig.aux_layer_ids = \[4\]: id\(s\) \[4\] were not captured"
    ):
        SelectedLayers(samples, manifest["aux_layer_ids"], [4], num_hidden_layers=5)
    ram = preload_samples(path, [3, 5, 1], num_hidden_layers=5)
    assert len(ram) == len(samples)
    for i in (0, 7, 13):  # across shards, equal to the memory-mapped selection
        for k in ("input_ids", "aux_hidden_states", "last_hidden_states"):
            assert torch.equal(torch.as_tensor(ram[i][k]), torch.as_tensor(sel[i][k])), (i, k)


def test_pack_batch_and_prefetch_equal_the_plain_loader(captured):
    samples = captured[0]
    rows = [[samples[0], samples[1]], [samples[2]], []]
    b = pack_batch(rows, 64)
    n0, n1, n2 = (len(samples[i]["input_ids"]) for i in range(3))
    assert torch.equal(b.input_ids[0, :n0], torch.as_tensor(samples[0]["input_ids"]).long())
    assert torch.equal(
        b.aux[0, n0 : n0 + min(n1, 64 - n0)].view(-1, 3, 128)[0],
        torch.as_tensor(samples[1]["aux_hidden_states"][0]),
    )
    assert (
        b.positions[0, n0].item() == 0 and b.doc_ids[0, n0].item() == 1
    )  # the second document restarts
    assert (
        (b.doc_ids[1, n2:] == -1).all()
        and not b.loss_mask[1, n2:].any()
        and (b.aux[1, n2:] == 0).all()
    )
    assert (b.doc_ids[2] == -1).all() and (
        b.last_hidden[2] == 0
    ).all()  # an empty row is all padding
    one = pack(rows[0], 64)
    assert all(torch.equal(one[f], getattr(b, f)[0]) for f in one)
    plain = PackedLoader(samples, range(12), 64, 2, seed=1)
    ahead = PackedLoader(
        samples, range(12), 64, 2, seed=1, prefetch=3, num_workers=2
    )  # packed side by side
    for _ in range(9):  # crosses epochs
        x, y = next(plain), next(ahead)
        assert x.target_argmax is None and y.target_argmax is None  # these samples carry none
        assert x.step_weight is None and y.step_weight is None
        assert all(
            torch.equal(getattr(x, f), getattr(y, f))
            for f in x.__dataclass_fields__
            if f not in ("target_argmax", "step_weight")
        )
        assert (
            plain.state_dict() == ahead.state_dict()
        )  # the position handed out, not the producer's
    resumed = PackedLoader(samples, range(12), 64, 2, seed=1, prefetch=2)
    resumed.load_state_dict(ahead.state_dict())
    assert torch.equal(next(resumed).input_ids, next(plain).input_ids)
    with pytest.raises(RuntimeError, match="after batches were planned ahead"):
        ahead.load_state_dict({"epoch": 0, "cursor": 0})
    ahead.close(finished=False)


def test_threads_packing_from_the_shards_equal_the_plain_loader(captured):
    """Batches planned from the capture's sample lengths alone and packed by several threads reading
    the memory- mapped shards side by side come out as the in-memory loader packs them, in order."""
    from eagle3.train.data import load_samples

    samples, path = captured[0], captured[3]
    memory = PackedLoader(samples, range(14), 64, 2, seed=1)
    disk = PackedLoader(load_samples(path), range(14), 64, 2, seed=1, prefetch=5, num_workers=3)
    for _ in range(12):  # several epochs, three shards
        x, y = next(memory), next(disk)
        assert all(
            torch.equal(getattr(x, f), getattr(y, f))
            for f in x.__dataclass_fields__
            if f not in ("target_argmax", "step_weight")
        )
        assert memory.state_dict() == disk.state_dict() and memory.last_rows == disk.last_rows
    assert disk.name_nonfinite(disk.last_rows) is None and disk.wait_s > 0
    disk.close(finished=False)


def test_padded_eval_batches_score_the_same(captured, tiny_llama):
    from eagle3.artifacts import DraftVocab
    from eagle3.train.loss import TargetHead
    from eagle3.train.trainer import build_draft, read_target_config
    from eagle3.weights import load_target_tensors

    samples, manifest, vocab, _ = captured
    d2t, t2d = DraftVocab.load(vocab).torch_maps()
    tensors = load_target_tensors(tiny_llama)
    cfg = TrainConfig(target=str(tiny_llama), vocab=str(vocab))
    model = build_draft(cfg, read_target_config(tiny_llama), tensors, d2t, t2d, num_aux=3)
    head = TargetHead(tensors["norm"], 1e-6, tensors["lm_head"], torch.arange(d2t.numel()) + d2t)
    padded = eval_batches(samples, range(14), 64, 4)
    assert {b.input_ids.shape[0] for b in padded} == {4}  # the training shape, every batch
    plain = [collate([pack([samples[i]], 64)]) for i in range(14)]
    kw = dict(steps=3, device="cpu", dtype=torch.float32, replay_k=3, attention="naive")
    m1, m2 = (
        score_batches(TTTModule(model), padded, head, **kw),
        score_batches(TTTModule(model), plain, head, **kw),
    )
    for k in ("acc_0", "cond_acc_2", "loss_1", "tau_replay", "num_rounds"):
        assert m1[k] == pytest.approx(m2[k], rel=1e-5), k


def test_train_with_layer_subset_val_capture_and_estimate(captured, tiny_llama, tmp_path):
    from eagle3.config import ExportConfig
    from eagle3.export import run_export
    from eagle3.train import run_train

    samples, manifest, vocab, path = captured
    # a second capture dir for validation (train refuses val_captured == captured; the plumbing is
    # what is tested)
    val = shutil.copytree(path, tmp_path / "val_capture")
    cfg = TrainConfig(
        target=str(tiny_llama),
        captured=str(path),
        vocab=str(vocab),
        out=tmp_path / "t",
        max_steps=6,
        checkpoint={"eval_every": 3},
        loader={"max_seq_len": 64, "batch_size": 2, "preload": True, "hidden_noise": 0.1},
        loss={"ttt_steps": 3},
        optimizer={"lr": 3e-3},
        draft={"init_head_from_target": True},
        aux_layer_ids=[1, 5],
        val_captured=str(val),
    )
    res = run_train(cfg)
    assert res.metadata["aux_layer_ids"] == [1, 5] and res.metadata["captured_aux_layer_ids"] == [
        1,
        2,
        3,
    ]
    splits = [
        json.loads(x)["split"]
        for x in (tmp_path / "t" / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert (
        splits.count("val") == 2 and splits.count("heldout") == 2
    )  # val_fraction's split is still logged
    best = json.loads((tmp_path / "t" / "best" / "eagle3_draft.json").read_text())
    out = run_export(
        ExportConfig(
            checkpoint=str(tmp_path / "t" / "best"), out=tmp_path / "draft", target=str(tiny_llama)
        )
    )
    assert out.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 5]
    est = estimate_acceptance(
        EstimateConfig(
            draft=tmp_path / "draft",
            captured=path,
            target=tiny_llama,
            max_seq_len=64,
            batch_size=2,
            attention="naive",
            max_new_tokens=None,
        )
    )
    assert est.tau == pytest.approx(
        best["metrics"]["tau_estimate"], rel=1e-4
    )  # exported == trained weights (bf16)
    assert est.num_rounds > 0 and 1.0 <= est.tau <= 4.0


def test_estimate_cli_names_a_bad_draft_dir(captured, tiny_llama, tmp_path, capsys):
    from eagle3.cli import main

    path = captured[3]
    assert (
        main(
            [
                "estimate",
                "--draft",
                str(tmp_path),
                "--captured",
                str(path),
                "--target",
                str(tiny_llama),
            ]
        )
        == 2
    )
    assert f"draft={tmp_path}: no eagle3_draft.json" in capsys.readouterr().err
