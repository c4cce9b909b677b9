"""`eagle3 refine` on a tiny random target (hf backend, CPU): the pipeline step between train and
export, the error-position finder against an explicit loop, the cache, the CLI and its refusals."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

ASSETS = Path(__file__).resolve().parents[1] / "src" / "eagle3" / "assets"


def tiny_pipeline(target: Path, work_dir: Path, **refine):
    """The cheapest real pipeline (hf capture on CPU, a few training steps), refine enabled."""
    from eagle3.config import PipelineConfig

    cpu32 = {"device": "cpu", "dtype": "float32"}
    return PipelineConfig.model_validate(
        {
            "name": "tiny-refine",
            "target": str(target),
            "data": str(ASSETS / "demo_chats.jsonl"),
            "work_dir": str(work_dir),
            "regenerate": {"enabled": False},
            "prepare": {"max_seq_len": 160, "limit": 10},
            "capture": {
                "backend": "hf",
                **cpu32,
                "storage_dtype": "float32",
                "batch_tokens": 1024,
                "shard_tokens": 4096,
            },
            "vocab": {"draft_vocab_size": 128},
            "train": {
                "loss": {"ttt_steps": 3},
                "schedule": {"warmup_steps": 1},
                "loader": {"max_seq_len": 160, "val_fraction": 0.25},
                "checkpoint": {"eval_every": 3, "save_every": 3, "log_every": 1},
                "max_steps": 3,
                "device": "cpu",
                "runtime": {"dtype": "float32"},
            },
            "refine": {
                "enabled": True,
                "rounds": 1,
                "temperatures": [0.0, 0.6],
                "num_prompts": 3,
                "num_val_prompts": 2,
                "max_new_tokens": 10,
                "steps_per_round": 6,
                "optimizer": {"lr": 3e-3},
                "schedule": {"warmup_steps": 0},
                "dtype": "float32",
                "storage_dtype": "float32",
                "generate_batch_size": 8,
                "capture_batch_tokens": 1024,
                **refine,
            },
        }
    )


@pytest.fixture(scope="module")
def piped(tiny_llama, tmp_path_factory):
    from eagle3.pipeline import run_pipeline

    cfg = tiny_pipeline(tiny_llama, tmp_path_factory.mktemp("refine") / "work")
    return cfg, run_pipeline(cfg)


def test_refine_runs_between_train_and_export_and_exports(piped, tmp_path):
    from eagle3.cli import main
    from eagle3.pipeline import enabled_stages

    cfg, res = piped
    assert enabled_stages(cfg) == ["prepare", "capture", "vocab", "train", "refine", "export"]
    off = cfg.model_copy(update={"refine": cfg.refine.model_copy(update={"enabled": False})})
    assert enabled_stages(off) == ["prepare", "capture", "vocab", "train", "export"]
    assert off.resolved().export.checkpoint == str(Path(cfg.work_dir) / "train")
    r, work = res.stages["refine"], Path(cfg.work_dir)
    assert r.checkpoint == work / "train" / "best" and r.num_speculative_tokens == 3
    assert set(r.alpha_before) == {"t0", "t0.6", "all"}
    assert all(len(a) == 3 for a in r.alpha_after.values())
    rec = r.rounds[0]
    assert rec["replay_before"]["num_rounds"] > 0 and r.num_rejected_blocks > 0
    assert rec["rollouts"]["num_rollouts"] == 2 * 3 and rec["num_trained_rollouts"] > 0
    # the refine loss trains the rounds' rejected positions (among others): their loss goes down
    assert rec["rejected_loss_after"] < rec["rejected_loss_before"] - 0.01
    out = work / "refine"
    for d in ("best", "final", "checkpoints/step-6"):
        assert (out / d / "model.safetensors").is_file(), d
        assert (out / d / "eagle3_draft.json").is_file(), d
    logs = [json.loads(x) for x in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in logs if x["split"] == "refine_val"] == [0, 1]
    assert [x["step"] for x in logs if x["split"] == "train"][-1] == 6 and "alpha_all_3" in logs[0]
    # the pipeline's export read refine's output, and says so
    assert res.stages["export"].checkpoint == out / "best"
    exported = json.loads((work / "draft" / "eagle3_draft.json").read_text())["refine"]
    assert exported["from_checkpoint"] == str((work / "train" / "best").resolve())
    assert exported["rounds"] == 1 and exported["round"] == r.selected_round
    assert main(["export", "--checkpoint", str(out), "--out", str(tmp_path / "draft")]) == 0
    again = json.loads((tmp_path / "draft" / "eagle3_draft.json").read_text())["refine"]
    assert again["alpha_before"] == r.alpha_before["all"]


def test_rerun_with_the_same_inputs_reuses_the_output(piped):
    from eagle3.refine import run_refine

    cfg, res = piped
    out = Path(cfg.work_dir) / "refine"
    files = [p for p in out.rglob("*") if p.is_file() and ".eagle3.lock" not in p.name]
    mtimes = {p: p.stat().st_mtime_ns for p in files}
    t0 = time.time()
    again = run_refine(cfg.resolved().refine)
    assert again.reused and time.time() - t0 < 10
    assert again.alpha_after == res.stages["refine"].alpha_after
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes  # nothing rewritten


def draft_token(model, ids: torch.Tensor, aux: torch.Tensor, t: int, j: int) -> int:
    """The target id of the token the draft drafts at step j of a round at row t of `ids` (its TTT
    unroll: step i reads token t+1+i, the token step i-1 drafted when the round accepted it)."""
    from eagle3.train.attention import make_ttt_attention

    T = len(ids)
    attn = make_ttt_attention("naive", torch.zeros(1, T, dtype=torch.long), j + 1)
    hidden, cache = model.combine(aux), model.new_cache()  # (1, T, H)
    for i in range(j + 1):
        nxt = torch.cat([ids[1 + i :], ids.new_zeros(1 + i)])[None]  # (1, T): row t reads t+1+i
        out, hidden = model.step(nxt, hidden, torch.arange(T)[None] + i, cache, attn)
    tok = int(model.lm_head(out[0, t]).argmax())
    return tok + int(model.d2t[tok])


def with_designed_rounds(model, sample: dict, k: int, first: int) -> tuple[dict, list]:
    """The sample with its answer rewritten so that the draft's rounds accept n = first, first+1,
    ... (mod k+1) tokens in turn: a round at row t drafts tokens t+2.., the accepted ones are set
    to the draft's own and the first rejected one to another token. Returns the sample and the
    designed (round-start row, n) pairs."""
    ids = torch.as_tensor(sample["input_ids"]).clone().long()  # (T,)
    aux = torch.as_tensor(sample["aux_hidden_states"]).float().flatten(-2)[None]  # (1, T, A*H)
    # the first round: one row after the first answer token's row (the prefill emitted that one)
    t = int(torch.as_tensor(sample["loss_mask"]).nonzero()[0, 0]) - 1
    rounds, n = [], first
    while t + 2 + k < len(ids):
        for j in range(min(n + 1, k)):
            tok = draft_token(model, ids, aux, t, j)
            ids[t + 2 + j] = tok if j < n else (tok + 1) % model.t2d.numel()
        rounds.append((t, n))
        t, n = t + n + 1, (n + 1) % (k + 1)
    return {**sample, "input_ids": ids}, rounds


def test_error_position_finder_matches_an_explicit_loop(piped):
    """find_rejected_blocks (several rollouts packed per row, two rows per batch) against one
    rollout at a time and an explicit walk (the first round one row after the first answer row, a
    round accepting n moves n+1 rows on), on rollouts rewritten to hold designed rounds."""
    from eagle3.train.data import CapturedDataset, SelectedLayers, pack_batch
    from eagle3.train.estimate import load_draft_dir
    from eagle3.train.loss import TargetHead
    from eagle3.train.onpolicy import find_rejected_blocks
    from eagle3.train.step import TTTModule, ttt_forward
    from eagle3.weights import load_target_tensors

    cfg, _ = piped
    work = Path(cfg.work_dir)
    model, meta = load_draft_dir(work / "train" / "best", cfg.target)
    model.eval()
    t = load_target_tensors(cfg.target)
    head = TargetHead(t["norm"], 1e-6, t["lm_head"], torch.arange(model.d2t.numel()) + model.d2t)
    raw = CapturedDataset(work / "refine" / "validation" / "captured")
    samples = SelectedLayers(raw, raw.manifest.aux_layer_ids, meta.aux_layer_ids, 5)
    k, K = 3, 4
    with torch.no_grad():
        designed = [
            with_designed_rounds(model, samples[i], k, first=i % (k + 1))
            for i in range(len(samples))
        ]
    samples = [x for x, _ in designed]
    got = find_rejected_blocks(
        TTTModule(model),
        samples,
        head,
        k=k,
        steps=K,
        max_seq_len=320,
        batch_size=2,
        device="cpu",
        dtype=torch.float32,
        attention="naive",
        rejected_weight=2.5,
    )
    seen_n = set()
    for i, s in enumerate(samples):
        b = pack_batch([[s]], len(s["input_ids"]))
        with torch.no_grad():
            o = ttt_forward(
                model,
                b,
                head,
                steps=k,
                attention="naive",
                return_correct=True,
                accept_on="next_token",
            )
        ok, valid = (o.correct & o.valid)[:, 0], o.valid[0, 0]  # (k, T), (T,)
        want, weights = [], torch.zeros(len(s["input_ids"]), K)
        t = int(valid.nonzero()[0, 0]) + 1
        while t < len(valid) and valid[t]:
            n = 0
            while n < k and ok[n, t]:
                n += 1
            want.append((t, n))
            weights[t, : min(n + 1, k)] = 1.0
            if n < k:
                weights[t, n] = 2.5
            t += n + 1
        assert got.rounds[i] == want and want[: len(designed[i][1])] == designed[i][1], i
        assert torch.equal(got.step_weights[i], weights), i
        assert torch.equal(got.error_masks[i], (weights == 2.5).float()), i
        seen_n |= {n for _, n in want}
    assert seen_n == {0, 1, 2, 3}  # rejections at every position, and fully accepted rounds
    assert got.num_rejected_blocks == sum(n < k for rs in got.rounds.values() for _, n in rs)


def test_cli_flags_and_refusals(piped, tmp_path):
    from tests.synthetic_capture import write_vocab

    from eagle3.cli import build_parser, stage_config_from_args
    from eagle3.config import ConfigError
    from eagle3.refine import run_refine

    cfg, _ = piped
    work = Path(cfg.work_dir)
    args = build_parser().parse_args(
        [
            "refine",
            "--target",
            str(cfg.target),
            "--checkpoint",
            str(work / "train"),
            "--data",
            f"{work / 'prepared'},{work / 'prepared'}",
            "--vocab",
            str(work / "vocab"),
            "--out",
            str(tmp_path / "r"),
            "--backend",
            "hf",
            "--device",
            "cpu",
            "--rounds",
            "2",
            "--temperatures",
            "0.0,0.6",
            "--num-prompts",
            "5",
            "--max-new-tokens",
            "7",
            "--optimizer-lr",
            "1e-5",
            "--steps-per-round",
            "3",
            "--supervised-share",
            "0.25",
            "--captured",
            str(work / "captured"),
        ]
    )
    r = stage_config_from_args("refine", args)
    got = (
        r.backend,
        r.device,
        r.rounds,
        r.temperatures,
        r.num_prompts,
        r.max_new_tokens,
        r.optimizer.lr,
        r.steps_per_round,
        r.supervised_share,
    )
    assert got == ("hf", "cpu", 2, [0.0, 0.6], 5, 7, 1e-5, 3, 0.25)
    base = cfg.resolved().refine.model_copy(update={"out": tmp_path / "r"})
    with pytest.raises(ConfigError, match="--data"):
        run_refine(base.model_copy(update={"data": None}))
    with pytest.raises(ConfigError, match=r"captured.*--captured CAPTURE_DIR.*--supervised-share"):
        run_refine(base.model_copy(update={"captured": str(tmp_path / "nowhere")}))
    other = str(write_vocab(tmp_path / "v", 512, torch.arange(128)))
    with pytest.raises(ConfigError, match=r"RefineConfig.vocab.*d2t differs"):
        run_refine(base.model_copy(update={"vocab": other}))
    with pytest.raises(ConfigError, match="max-new-tokens"):
        run_refine(base.model_copy(update={"max_new_tokens": 500}))


def test_mixed_loader_spreads_the_supervised_share_and_resumes():
    """supervised_share s: micro-batch i is supervised iff floor((i+1)s) > floor(is), so s of them,
    evenly spread; the state (both loaders' positions and the count) resumes the same sequence;
    rollout batches carry step weights, supervised ones none."""
    from tests.test_train import fake_samples

    from eagle3.train.data import PackedLoader
    from eagle3.train.onpolicy import MixedLoader, StepWeighted

    rollouts = StepWeighted(fake_samples([5, 3, 9, 4]), [torch.ones(n, 2) for n in (5, 3, 9, 4)])
    supervised = fake_samples([6, 2, 7])

    def mixed(share):
        return MixedLoader(
            PackedLoader(rollouts, range(4), 10, 1, seed=0),
            PackedLoader(supervised, range(3), 10, 1, seed=0),
            share,
        )

    loader = mixed(0.25)
    sources = []
    for _ in range(8):
        b = next(loader)
        sources.append(loader.last_source)
        assert (b.step_weight is not None) == (loader.last_source == "rollouts")
    assert sources == ["rollouts", "rollouts", "rollouts", "supervised"] * 2
    first = mixed(0.5)
    for _ in range(3):
        next(first)
    again = mixed(0.5)
    again.load_state_dict(first.state_dict())
    for _ in range(4):
        assert torch.equal(next(first).input_ids, next(again).input_ids)
    with pytest.raises(ValueError, match="needs supervised batches"):
        MixedLoader(PackedLoader(rollouts, range(4), 10, 1, seed=0), None, 0.5)
