"""`eagle3 refine`: on-policy refinement of a trained EAGLE-3 draft.

A draft trained on fixed target trajectories is served on rounds it drafts itself. Each round:

1. rollouts: the target continues `num_prompts` prompts of the TRAINING sources (the prepared
   data's prompts, eagle3.data.rollout; never eval prompts) at every temperature of
   `temperatures`, through the regenerate stage's generators (backend vllm, or hf: transformers
   generate). The continuation is the target's, so the text is exactly what serving emits. The
   capture stage (same backend, the checkpoint's captured aux ids) records the target's states.
2. replay: the draft's drafting rounds over the rollouts, k = num_speculative_tokens tokens each,
   replayed as the offline estimator replays vLLM (eagle3.train.onpolicy.find_rejected_blocks):
   every round's start row and first rejected position. A draft token is accepted when it is the
   rollout's next token. Greedy, that is the target's argmax; sampled, it is exact too: vLLM's
   rejection sampler, given EAGLE's greedy draft with one-hot draft probabilities, accepts a draft
   token iff it emits it.
3. training, from the current draft: the TTT loss at those rounds only (each round's steps up to
   and including its first rejected one; the next round starts at the rejected token, as in vLLM:
   `loss_rows: rounds`) or at every row (`loss_rows: all`) on 1 - supervised_share of the
   micro-batches; the others are supervised batches of the training capture (the plain TTT loss),
   so that nothing is forgotten. `steps_per_round` steps of the trainer's own loop at a lower lr.

A VALIDATION split of the same sources (`num_val_prompts` prompts held out of every round, rolled
out once) gives the per-position acceptance α (position j: accepted / reached) and τ before and
after each round, per temperature and pooled. best/ holds the round (0 = the input draft) with the
highest pooled τ, final/ the last round's.

Output (`out`), laid out as a training run, so `eagle3 export --checkpoint OUT` works unchanged (it
exports best/; its eagle3_draft.json records `refine`: the input checkpoint, the rounds, α):
    best/, final/          model.safetensors + eagle3_draft.json
    checkpoints/step-N/    the state at the end of each round (N: optimizer steps of all rounds)
    logs/metrics.jsonl     every round's `train` records (global steps), `refine_val` (α and τ per
                           round, round 0 = the input) and `refine_rollouts` (rounds replayed,
                           rejected blocks, the loss at the rejected positions before/after)
    curves.png, refine.json (the summary `eagle3 refine` prints, with the run's content key)
    validation/            the validation rollouts: rollouts/ (prepared), captured/, rollouts.json
    rounds/round-R/        its rollouts, capture, training dir (logs, final/) and round.json
Caching by content: a round's rollouts are keyed by their prompts and settings (not by the draft:
the target's text does not depend on it), a round by the previous round's key (the first by the
input weights), its rollouts, every replay and training setting, the supervised capture and the
validation set. A rerun reuses what is unchanged: rounds, rollouts, or the whole run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.artifacts import (
    CaptureManifest,
    DraftMetadata,
    DraftVocab,
    PreparedMeta,
    list_checkpoints,
)
from eagle3.capture import run_capture
from eagle3.config import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    CaptureConfig,
    ConfigError,
    RefineConfig,
    RegenerateConfig,
    TrainConfig,
    deep_merge,
)
from eagle3.data.regenerate import open_generator, open_renderer
from eagle3.data.rollout import (
    RolloutSettings,
    data_dirs,
    generate_rollouts,
    prompts_sha256,
    read_prompts,
    round_prompts,
    split_prompts,
    write_rollouts,
)
from eagle3.export import WEIGHTS, resolve_checkpoint
from eagle3.integrity import check_target_identity
from eagle3.io import atomic_dir, atomic_path, read_json, sha256_file, sha256_json, write_json
from eagle3.lock import dir_lock
from eagle3.model.draft import text_config
from eagle3.splits import split_indices
from eagle3.train import parallel
from eagle3.train.data import (
    CapturedDataset,
    PackedLoader,
    SelectedLayers,
    eval_batches,
    load_samples,
)
from eagle3.train.estimate import RoundCounts, load_draft_dir, score_batches
from eagle3.train.loop import Run, TrainState, build_optimizer, save_final, train_loop
from eagle3.train.loss import TargetHead
from eagle3.train.metrics import MetricsLog, plot_curves
from eagle3.train.onpolicy import (
    MixedLoader,
    StepWeighted,
    all_rows_weights,
    find_rejected_blocks,
    weighted_ce,
)
from eagle3.train.step import TTTModule
from eagle3.train.trainer import freeze_parameters
from eagle3.train_options import TRAIN_GROUPS
from eagle3.weights import load_target_tensors, read_target_config

SUMMARY = "refine.json"
ROUND_RECORD = "round.json"
ROLLOUT_RECORD = "rollouts.json"


@dataclass
class RefineResult:
    out: Path
    best_dir: Path
    final_dir: Path
    checkpoint: Path  # the refined input
    num_speculative_tokens: int
    num_rounds: int
    selected_round: int  # best/'s round (0 = the input draft)
    num_rollouts: int  # training rollouts, every round
    num_rejected_blocks: int  # replayed rounds with a rejected token, every round's rollouts
    alpha_before: dict[str, list[float]]  # validation α at positions 1..k per temperature, "all"
    alpha_after: dict[str, list[float]]  # the same for best/
    tau_before: dict[str, float]
    tau_after: dict[str, float]
    rounds: list[dict[str, Any]] = field(default_factory=list)  # each round's figures
    num_val_prompts: int = 0
    num_train_prompts: int = 0
    wall_s: float = 0.0
    reused: bool = False  # the whole run was read back (same inputs)


def say(message: str) -> None:
    print(f"refine: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------- inputs


@dataclass
class Plan:
    """Everything resolved from the config and the checkpoint before anything runs."""

    cfg: RefineConfig
    checkpoint: Path  # the dir holding the input weights + eagle3_draft.json
    meta: DraftMetadata
    train: TrainConfig  # each round's training config: the checkpoint's + refine's overrides
    k: int
    backend: str
    num_layers: int
    captured_aux: list[int]  # the aux ids the rollouts are captured at (the draft's capture's)
    aux_layer_ids: list[int]  # the draft's
    identity: dict[str, Any]
    supervised: str | None  # capture dir(s) mixed in; None when supervised_share is 0
    max_prompt_tokens: int


def read_plan(cfg: RefineConfig) -> Plan:
    """The checkpoint, k, the supervised capture and the training config; a ConfigError naming the
    field and the fix for anything missing or inconsistent."""
    cfg.require("target", "checkpoint", "data", "out")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError(
            "eagle3 refine runs in one process on one device (its rollouts and "
            "rounds are not split across ranks); start it without torchrun"
        )
    ck = resolve_checkpoint(cfg.checkpoint)
    meta = DraftMetadata.load(ck)
    tpath = Path(cfg.target) / "config.json"
    if not tpath.is_file():
        raise ConfigError(
            f"RefineConfig.target = {cfg.target!r} has no config.json; pass --target "
            "with the target model dir the draft was trained for"
        )
    identity = check_target_identity(
        meta.recorded_target(), f"checkpoint {ck}", cfg.target, cfg.allow_target_mismatch
    )
    num_layers = int(text_config(read_json(tpath))["num_hidden_layers"])
    trained_with = recorded_settings(meta)
    k = int(
        cfg.num_speculative_tokens
        or trained_with.get("num_speculative_tokens")
        or DEFAULT_NUM_SPECULATIVE_TOKENS
    )
    for d in data_dirs(cfg.data):
        if not (d / PreparedMeta.FILE).is_file():
            raise ConfigError(
                f"RefineConfig.data: {d} is not a prepared dataset (no "
                f"{PreparedMeta.FILE}); pass --data with the `eagle3 prepare` "
                "output dir(s) "
                "of the training sources"
            )
    _check_vocab(cfg, meta, ck / WEIGHTS)
    supervised = None
    if cfg.supervised_share > 0:
        supervised = cfg.captured or meta.captured
        missing = [
            str(d) for d in data_dirs(supervised or "") if not (d / CaptureManifest.FILE).is_file()
        ]
        if not supervised or missing:
            raise ConfigError(
                f"RefineConfig.captured = {supervised!r}: no capture at {missing or supervised!r} "
                f"(supervised_share = {cfg.supervised_share} mixes supervised batches in); pass "
                "--captured CAPTURE_DIR with the draft's training capture, or --supervised-share 0"
            )
        check_target_identity(
            CaptureManifest.load_combined(supervised).recorded_target(),
            f"captured={supervised}",
            cfg.target,
            cfg.allow_target_mismatch,
            identity=identity,
        )
    trained_loader = trained_with.get("loader", {})
    max_seq_len = cfg.max_seq_len or int(trained_loader.get("max_seq_len", 2048))
    if max_seq_len - cfg.max_new_tokens < 1:
        raise ConfigError(
            f"RefineConfig.max_new_tokens = {cfg.max_new_tokens} leaves no room for "
            f"a prompt in max_seq_len = {max_seq_len}; lower --max-new-tokens or "
            "raise --max-seq-len"
        )
    steps = cfg.steps_per_round
    trained_log_every = int(trained_with.get("checkpoint", {}).get("log_every", 10))
    round_settings = {  # the checkpoint's own settings, but for these
        "target": cfg.target,
        "captured": supervised or meta.captured,
        "vocab": cfg.vocab or meta.vocab,
        "out": None,
        "val_captured": None,
        "aux_layer_ids": list(meta.aux_layer_ids),
        "max_steps": steps,
        "num_speculative_tokens": k,
        "seed": cfg.seed,
        "device": cfg.device,
        "loader": {
            "max_seq_len": max_seq_len,
            "batch_size": cfg.batch_size or trained_loader.get("batch_size", 1),
            "verify_capture": False,
        },
        "loss": {"ttt_steps": max(int(meta.ttt_steps or 0), k), "weighting": cfg.loss_weighting},
        "optimizer": cfg.optimizer.model_dump(),
        "schedule": cfg.schedule.model_dump(),
        "checkpoint": {
            "eval_every": steps,
            "save_every": steps,
            "log_every": min(trained_log_every, steps),
            "resume": False,
            "ema_decay": 0.0,
        },
        "runtime": {"compile_cache": None},
    }
    train = TrainConfig.model_validate(deep_merge(trained_with, round_settings))
    captured_aux = list(meta.captured_aux_layer_ids or meta.aux_layer_ids)
    return Plan(
        cfg,
        ck,
        meta,
        train,
        k,
        cfg.backend or "vllm",
        num_layers,
        [i for i in captured_aux if i != num_layers],
        list(meta.aux_layer_ids),
        identity,
        supervised,
        max_seq_len - cfg.max_new_tokens,
    )


def recorded_settings(meta: DraftMetadata) -> dict[str, Any]:
    """The training settings the checkpoint records (its TrainConfig, in groups), those this
    version still has: a record keeps every flag it was trained with, some since removed."""
    out: dict[str, Any] = {}
    for key, value in (meta.train_config or {}).items():
        if key in TRAIN_GROUPS and isinstance(value, dict):
            fields = TRAIN_GROUPS[key].model_fields
            out[key] = {k: v for k, v in value.items() if k in fields}
        elif key in TrainConfig.model_fields and key not in TRAIN_GROUPS:
            out[key] = value
    return out


def _check_vocab(cfg: RefineConfig, meta: DraftMetadata, weights: Path) -> None:
    """An explicit --vocab must hold the checkpoint's own d2t (its head rows are in that order)."""
    if not cfg.vocab:
        return
    try:
        d2t, _ = DraftVocab.load(cfg.vocab).torch_maps()
    except FileNotFoundError as e:
        raise ConfigError(f"RefineConfig.vocab: {e}") from None
    own = _read_d2t(weights.parent)
    if d2t.shape != own.shape or not torch.equal(d2t, own):
        raise ConfigError(
            f"RefineConfig.vocab = {cfg.vocab!r}: its d2t differs from the "
            f"checkpoint's ({weights}); pass the vocab the draft was trained with "
            f"({meta.vocab}) or leave --vocab unset"
        )


def _read_d2t(ck: Path) -> torch.Tensor:
    with safe_open(str(ck / "model.safetensors"), framework="pt") as f:
        return f.get_tensor("d2t").long()


# ---------------------------------------------------------------------------------------- keys


def rollout_settings(plan: Plan) -> dict[str, Any]:
    """What makes rollouts and their capture what they are, besides their prompts and seed."""
    c = plan.cfg
    return {
        "target": plan.identity,
        "temperatures": list(c.temperatures),
        "top_p": c.top_p,
        "max_new_tokens": c.max_new_tokens,
        "backend": plan.backend,
        "dtype": c.dtype,
        "storage_dtype": c.storage_dtype,
        "aux": plan.captured_aux,
    }


def rollout_key(plan: Plan, prompts_sha256: str, seed: int) -> str:
    return sha256_json({"prompts": prompts_sha256, "seed": seed, **rollout_settings(plan)})


def round_keys(plan: Plan, input_key: str, val_key: str, rollout_keys: list[str]) -> list[str]:
    """Round r's content key: the previous one's (the first: the input weights'), its rollouts,
    every replay and training setting, the supervised capture and the validation set."""
    c = plan.cfg
    train = plan.train.model_dump(mode="json", exclude={"device", "out", "target"})
    supervised = None
    if plan.supervised:
        shards = CaptureManifest.load_combined(plan.supervised).shards
        supervised = sha256_json([e.to_dict() for e in shards])
    keys, prev = [], input_key
    for r, rk in enumerate(rollout_keys, start=1):
        prev = sha256_json(
            {
                "previous": prev,
                "round": r,
                "rollouts": rk,
                "k": plan.k,
                "train": train,
                "supervised": supervised,
                "supervised_share": c.supervised_share,
                "loss_rows": c.loss_rows,
                "rejected_weight": c.rejected_weight,
                "validation": val_key,
            }
        )
        keys.append(prev)
    return keys


# ---------------------------------------------------------------------------------------- rollouts


def ensure_rollouts(plan: Plan, where: Path, key: str, prompts: list, seed: int) -> dict[str, Any]:
    """Rollouts of `prompts` at every temperature, captured, in `where` (rollouts/, captured/,
    rollouts.json). Reused when rollouts.json holds `key`; generation is skipped when rollouts/
    holds it (a capture cut short resumes); otherwise `where` is cleared and both run. Returns
    rollouts.json."""
    c, rec = plan.cfg, where / ROLLOUT_RECORD
    if (
        rec.is_file()
        and read_json(rec).get("key") == key
        and (where / "captured" / CaptureManifest.FILE).is_file()
    ):
        return read_json(rec)
    rec.unlink(missing_ok=True)
    made = where / "rollouts" / PreparedMeta.FILE
    if not (made.is_file() and PreparedMeta.read(made).key == key):
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        regen = RegenerateConfig(
            target=c.target,
            max_new_tokens=c.max_new_tokens,
            top_p=c.top_p,
            seed=seed,
            batch_size=c.generate_batch_size,
            max_model_len=plan.train.loader.max_seq_len,
            backend=plan.backend,
            device=c.device,
            dtype=c.dtype,
            trust_remote_code=c.trust_remote_code,
            chat_template_kwargs=c.chat_template_kwargs,
        )
        gen, engine = open_generator(regen, open_renderer(regen))
        try:
            settings = RolloutSettings(list(c.temperatures), c.top_p, c.max_new_tokens, seed)
            rows, stats = generate_rollouts(gen, prompts, settings, c.generate_batch_size)
        finally:
            gen.close()
        if not rows:
            raise ValueError(
                f"refine: the target wrote nothing for {len(prompts)} prompts "
                f"({stats['finish_reasons']}); check the target and --max-new-tokens"
            )
        sources = [PreparedMeta.load(d) for d in data_dirs(c.data)]
        engine = json.loads(json.dumps(engine, default=str))
        write_rollouts(
            rows,
            where / "rollouts",
            sources,
            {
                "key": key,
                "seed": seed,
                "temperatures": list(c.temperatures),
                "top_p": c.top_p,
                "max_new_tokens": c.max_new_tokens,
                "engine": engine,
                "stats": stats,
            },
        )
        say(
            f"{stats['num_rollouts']} rollouts, {stats['generated_tokens']} tokens in "
            f"{stats['generate_s']} s ({stats['generated_tokens_per_s']} tokens/s) -> {where}"
        )
    stats = PreparedMeta.read(made).stats or {}
    cap = run_capture(
        CaptureConfig(
            target=c.target,
            data=str(where / "rollouts"),
            out=where / "captured",
            aux_layer_ids=plan.captured_aux,
            backend=plan.backend,
            device=c.device,
            dtype=c.dtype,
            storage_dtype=c.storage_dtype,
            batch_tokens=c.capture_batch_tokens,
            trust_remote_code=c.trust_remote_code,
        )
    )
    record = {
        "key": key,
        **stats,
        "num_captured": cap.num_samples,
        "captured_tokens": cap.num_tokens,
        "capture_s": cap.capture_s,
        "capture_skipped": cap.num_skipped,
    }
    write_json(rec, record)
    return record


def open_rollouts(plan: Plan, where: Path) -> tuple[Any, list[str]]:
    """(the samples of a captured rollout dir at the draft's aux ids, their sample ids)."""
    raw = CapturedDataset(where / "captured", verify=False)
    samples = SelectedLayers(raw, raw.manifest.aux_layer_ids, plan.aux_layer_ids, plan.num_layers)
    return samples, raw.sample_ids()


# ---------------------------------------------------------------------------------------- the draft


@dataclass
class Runtime:
    d: Any  # eagle3.train.parallel.Dist: the device
    amp: torch.dtype  # autocast dtype (float32 on the CPU)
    head: Any  # the target's TargetHead over the draft vocabulary, on the device


def open_runtime(plan: Plan) -> Runtime:
    d = parallel.setup(plan.train.device)
    cuda = d.device.type == "cuda"
    if cuda:  # as the trainer: host work packs small tensors; a full OpenMP team oversubscribes
        torch.set_num_threads(min(torch.get_num_threads(), 4))
    amp = torch.bfloat16 if cuda and plan.train.runtime.dtype == "bfloat16" else torch.float32
    tensors = load_target_tensors(plan.cfg.target)
    eps = text_config(read_target_config(plan.cfg.target)).get("rms_norm_eps", 1e-6)
    d2t = _read_d2t(plan.checkpoint)
    head = TargetHead(tensors["norm"], eps, tensors["lm_head"], torch.arange(d2t.numel()) + d2t)
    return Runtime(d, amp, head.to(d.device, amp))


def load_draft(plan: Plan, where: Path, rt: Runtime):
    """(the draft of `where` on the device, a TTTModule around it)."""
    model, _ = load_draft_dir(where, plan.cfg.target)  # its dropout as trained (draft_config)
    freeze_parameters(model, plan.train.draft.freeze)
    model = model.to(rt.d.device)
    return model, TTTModule(model)


def score(plan: Plan, ttt, samples, ids: list[str], rt: Runtime) -> dict[str, dict[str, Any]]:
    """The draft's replayed rounds on rollouts, per temperature (the sample id's prefix) and
    pooled ("all"): α at positions 1..k, τ and the number of rounds."""
    groups: dict[str, list[int]] = {}
    for i, sid in enumerate(ids):
        groups.setdefault(sid.split("/", 1)[0], []).append(i)
    out, pooled = {}, RoundCounts(0, [0] * plan.k)
    for label, idx in sorted(groups.items()):
        batches = eval_batches(
            samples, idx, plan.train.loader.max_seq_len, plan.train.loader.batch_size
        )
        m = score_batches(
            ttt,
            batches,
            rt.head,
            steps=plan.k,
            device=rt.d.device,
            dtype=rt.amp,
            replay_k=plan.k,
            attention=plan.train.runtime.attention,
            accept_on="next_token",
        )
        counts = RoundCounts(int(m["num_rounds"]), [int(m[f"accepted_{j}"]) for j in range(plan.k)])
        pooled.add(counts)
        out[label] = _figures(counts)
    out["all"] = _figures(pooled)
    return out


def _figures(counts) -> dict[str, Any]:
    return {
        "alpha": [round(a, 4) for a in counts.acceptance_per_position()],
        "tau": round(counts.tau, 4),
        "num_rounds": counts.num_rounds,
    }


# ---------------------------------------------------------------------------------------- a round


def run_round(
    plan: Plan,
    r: int,
    key: str,
    rdir: Path,
    start: Path,
    prompts: list,
    roll_key: str,
    rt: Runtime,
    val: tuple[Any, list[str]],
    step0: int,
) -> dict[str, Any]:
    """Round r from the draft in `start`: rollouts, replay, training (rdir/train), validation.
    Returns its round.json record."""
    c, t0 = plan.cfg, time.time()
    roll = ensure_rollouts(plan, rdir, roll_key, prompts, seed=round_seed(c.seed, r))
    samples, _ = open_rollouts(plan, rdir)
    model, ttt = load_draft(plan, start, rt)
    K = plan.train.loss.ttt_steps
    common = dict(
        max_seq_len=plan.train.loader.max_seq_len,
        batch_size=plan.train.loader.batch_size,
        device=rt.d.device,
        dtype=rt.amp,
        attention=plan.train.runtime.attention,
    )
    replay = find_rejected_blocks(
        ttt, samples, rt.head, k=plan.k, steps=K, rejected_weight=c.rejected_weight, **common
    )
    errors = StepWeighted(samples, replay.error_masks)  # each round's first rejected step only
    err_before = weighted_ce(ttt, errors, rt.head, steps=K, **common)
    if c.loss_rows == "rounds":
        weights, trained = replay.step_weights, replay.trained_samples()
    else:
        weights, trained = all_rows_weights(samples, K), list(range(len(samples)))
    if not trained:
        raise ValueError(
            f"refine round {r}: no rollout in {rdir} holds a drafting round to train "
            f"on ({len(samples)} rollouts); raise --max-new-tokens or --num-prompts"
        )
    say(
        f"round {r}: {replay.counts.num_rounds} rounds replayed on {len(samples)} rollouts, "
        f"{replay.num_rejected_blocks} rejected blocks, τ {replay.counts.tau:.3f}; training "
        f"{c.steps_per_round} steps"
    )
    state = train_round(
        plan, r, model, StepWeighted(samples, weights), trained, rdir / "train", rt, step0
    )
    after = find_rejected_blocks(ttt, samples, rt.head, k=plan.k, steps=K, **common)
    err_after = weighted_ce(ttt, errors, rt.head, steps=K, **common)
    return {
        "key": key,
        "round": r,
        "step": step0 + c.steps_per_round,
        "num_prompts": len(prompts),
        "rollouts": {k: v for k, v in roll.items() if k != "key"},
        "replay_before": {
            **_figures(replay.counts),
            "num_rejected_blocks": replay.num_rejected_blocks,
        },
        "replay_after": {
            **_figures(after.counts),
            "num_rejected_blocks": after.num_rejected_blocks,
        },
        "rejected_loss_before": _finite(err_before),
        "rejected_loss_after": _finite(err_after),
        "train_loss": state.last_loss,
        "num_trained_rollouts": len(trained),
        "validation": score(plan, ttt, *val, rt),
        "wall_s": round(time.time() - t0, 1),
    }


def round_seed(seed: int, r: int) -> int:
    """The sampling seed of round r's rollouts (0: the validation rollouts)."""
    return seed + 1000 * r


def _finite(x: float) -> float | None:
    return round(x, 6) if math.isfinite(x) else None


def train_round(
    plan: Plan, r: int, model, onpolicy, trained: list[int], out: Path, rt: Runtime, step0: int
):
    """`steps_per_round` optimizer steps of the trainer's loop (eagle3.train.loop) over a
    MixedLoader of rollout and supervised batches; `out` gets the round's logs, final/ and its
    last checkpoint. Returns the loop's TrainState."""
    c, tc = plan.cfg, plan.train.model_copy(update={"out": out})
    shutil.rmtree(out, ignore_errors=True)
    torch.manual_seed(tc.seed + r)  # dropout and hidden noise, as the trainer seeds them
    cuda = rt.d.device.type == "cuda"
    ahead = dict(
        prefetch=2 * tc.loader.num_workers if cuda else 0,
        num_workers=tc.loader.num_workers,
        pin_memory=cuda,
    )
    T, B = tc.loader.max_seq_len, tc.loader.batch_size
    rollouts = PackedLoader(onpolicy, trained, T, B, tc.seed + r, **ahead)
    supervised = None
    if plan.supervised:
        sup = SelectedLayers(
            load_samples(plan.supervised, verify=False),
            CaptureManifest.load_combined(plan.supervised).aux_layer_ids,
            plan.aux_layer_ids,
            plan.num_layers,
        )
        keep, _ = split_indices(len(sup), tc.loader.val_fraction, tc.seed)  # not train's val rows
        supervised = PackedLoader(sup, keep, T, B, tc.seed + r, **ahead)
    loader = MixedLoader(rollouts, supervised, c.supervised_share)

    def meta(step: int, metrics: dict) -> DraftMetadata:
        return output_metadata(plan, step0 + step, metrics, {"round": r})

    mode = parallel.choose_parallel(tc.runtime.parallel, model, rt.d)  # as the trainer wraps it
    ttt = parallel.wrap(TTTModule(model), rt.d, fsdp=mode == "fsdp2")
    run = Run(
        cfg=tc,
        d=rt.d,
        out=out,
        model=model,
        ttt=ttt,
        parallel=mode,
        head=rt.head,
        loader=loader,
        val=[],
        heldout=[],
        total=c.steps_per_round,
        amp_dtype=rt.amp,
        aux_layer_ids=plan.aux_layer_ids,
        draft_metadata=meta,
    )
    build_optimizer(run)
    state, log = TrainState(), MetricsLog(out, rt.d.main)
    try:
        train_loop(run, state, log)
        save_final(run, state)
    finally:
        log.close()
        loader.close(finished=True)
    return state


def output_metadata(plan: Plan, step: int, metrics: dict, refine: dict[str, Any]) -> DraftMetadata:
    """eagle3_draft.json of a refined draft: the input's, its step and metrics, and `refine`."""
    return DraftMetadata.from_dict(
        {
            **plan.meta.to_dict(),
            "step": step,
            "metrics": metrics,
            "refine": {
                "from_checkpoint": str(plan.checkpoint.resolve()),
                "from_step": plan.meta.step,
                "num_speculative_tokens": plan.k,
                "config": plan.cfg.model_dump(mode="json"),
                **refine,
            },
        },
        "refine output",
    )


# ---------------------------------------------------------------------------------------- the stage


def run_refine(cfg: RefineConfig) -> RefineResult:
    """Refine cfg.checkpoint on-policy for cfg.rounds rounds into cfg.out (module docstring)."""
    t0 = time.time()
    plan = read_plan(cfg)
    with dir_lock(cfg.out, "refine out"):
        return _refine(plan, t0)


def _refine(plan: Plan, t0: float) -> RefineResult:
    c, out = plan.cfg, Path(plan.cfg.out)
    found = read_prompts(c.data, plan.max_prompt_tokens)
    if len(found.prompts) < 2:
        raise ConfigError(
            f"RefineConfig.data = {c.data!r}: {len(found.prompts)} distinct prompts "
            f"(skipped {found.skipped}); refine needs 2 or more (validation and "
            "training): pass more data, or a larger --max-seq-len for long prompts"
        )
    num_val = min(c.num_val_prompts, len(found.prompts) - 1)
    val_prompts, pool = split_prompts(found.prompts, num_val, c.seed)
    per_round = [round_prompts(pool, r, c.num_prompts) for r in range(1, c.rounds + 1)]
    val_key = rollout_key(plan, prompts_sha256(val_prompts), round_seed(c.seed, 0))
    roll_keys = [
        rollout_key(plan, prompts_sha256(p), round_seed(c.seed, r))
        for r, p in enumerate(per_round, start=1)
    ]
    input_key = sha256_json(
        {
            "weights": sha256_file(plan.checkpoint / "model.safetensors"),
            "draft": plan.meta.draft_config,
            "aux": plan.aux_layer_ids,
        }
    )
    keys = round_keys(plan, input_key, val_key, roll_keys)
    summary = out / SUMMARY
    done = all((out / x / "model.safetensors").is_file() for x in ("best", "final"))
    if done and summary.is_file() and read_json(summary).get("key") == keys[-1]:
        say(f"{out} already holds this refinement (key {keys[-1][:12]}); nothing to do")
        return _result(read_json(summary), reused=True)
    say(
        f"{len(found.prompts)} prompts ({num_val} validation, {len(pool)} training; skipped "
        f"{found.skipped}), k = {plan.k}, {c.rounds} round(s) of {c.num_prompts} prompts x "
        f"{len(c.temperatures)} temperature(s)"
    )
    ensure_rollouts(plan, out / "validation", val_key, val_prompts, seed=round_seed(c.seed, 0))
    val = open_rollouts(plan, out / "validation")
    rt = open_runtime(plan)
    _, ttt = load_draft(plan, plan.checkpoint, rt)
    before = score(plan, ttt, *val, rt)
    say(f"validation before: α {before['all']['alpha']}, τ {before['all']['tau']}")
    records, start, step0 = [], plan.checkpoint, 0
    for r, key in enumerate(keys, start=1):
        rdir = out / "rounds" / f"round-{r}"
        rec = read_json(rdir / ROUND_RECORD) if (rdir / ROUND_RECORD).is_file() else {}
        if rec.get("key") == key and (rdir / "train" / "final" / "model.safetensors").is_file():
            say(f"round {r}: reused ({rdir})")
        else:
            _drop_checkpoints_after(out, step0)
            (rdir / ROUND_RECORD).unlink(missing_ok=True)
            rec = run_round(
                plan, r, key, rdir, start, per_round[r - 1], roll_keys[r - 1], rt, val, step0
            )
            _move_checkpoint(rdir / "train", out, c.steps_per_round, rec["step"])
            write_json(rdir / ROUND_RECORD, rec)
            v = rec["validation"]["all"]
            say(
                f"round {r}: validation α {v['alpha']}, τ {v['tau']}; loss at the rejected "
                f"positions {rec['rejected_loss_before']} -> {rec['rejected_loss_after']}"
            )
        records.append(rec)
        start, step0 = rdir / "train" / "final", rec["step"]
    _drop_stale(out, c.rounds, step0)
    return _write_outputs(plan, keys[-1], before, records, num_val, len(pool), t0)


def _move_checkpoint(train_dir: Path, out: Path, local_step: int, global_step: int) -> None:
    """The round's last checkpoint becomes out/checkpoints/step-<global step>."""
    src = train_dir / "checkpoints" / f"step-{local_step}"
    if src.is_dir():
        dst = out / "checkpoints" / f"step-{global_step}"
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dst, ignore_errors=True)
        src.replace(dst)
        shutil.rmtree(train_dir / "checkpoints", ignore_errors=True)


def _drop_checkpoints_after(out: Path, step: int) -> None:
    for ck in list_checkpoints(out):
        if int(ck.name.split("-")[1]) > step:
            shutil.rmtree(ck)


def _drop_stale(out: Path, rounds: int, step: int) -> None:
    """Rounds past the configured number (a rerun with fewer rounds) and their checkpoints go."""
    _drop_checkpoints_after(out, step)
    for rdir in (out / "rounds").glob("round-*"):
        index = rdir.name.split("-")[1]
        if index.isdigit() and int(index) > rounds:
            shutil.rmtree(rdir)


def _write_outputs(
    plan: Plan, key: str, before: dict, records: list[dict], num_val: int, num_pool: int, t0: float
) -> RefineResult:
    """best/ (the round of the highest pooled validation τ; 0 = the input), final/,
    logs/metrics.jsonl, curves.png and refine.json."""
    out = Path(plan.cfg.out)
    vals = [before] + [rec["validation"] for rec in records]
    sel = max(range(len(vals)), key=lambda i: (vals[i]["all"]["tau"], -i))  # ties: the earlier
    dirs = [plan.checkpoint] + [
        out / "rounds" / f"round-{rec['round']}" / "train" / "final" for rec in records
    ]
    steps = [0] + [rec["step"] for rec in records]
    info = {
        "rounds": len(records),
        "selected_round": sel,
        "alpha_before": before["all"]["alpha"],
        "tau_before": before["all"]["tau"],
        "validation_before": before,
    }
    for name, i in (("best", sel), ("final", len(records))):
        after = vals[i]["all"]
        meta = output_metadata(
            plan,
            steps[i],
            {"tau_replay": after["tau"]},
            {
                **info,
                "round": i,
                "alpha_after": after["alpha"],
                "tau_after": after["tau"],
                "validation_after": vals[i],
            },
        )
        with atomic_dir(out / name) as tmp:
            shutil.copy2(dirs[i] / "model.safetensors", tmp / "model.safetensors")
            meta.save(tmp)
    _write_log(out, before, records)
    plot_curves(out / "logs" / "metrics.jsonl", out / "curves.png")
    summary = {
        "key": key,
        "out": str(out),
        "best_dir": str(out / "best"),
        "final_dir": str(out / "final"),
        "checkpoint": str(plan.checkpoint),
        "num_speculative_tokens": plan.k,
        "num_rounds": len(records),
        "selected_round": sel,
        "num_rollouts": sum(rec["rollouts"]["num_rollouts"] for rec in records),
        "num_rejected_blocks": sum(rec["replay_before"]["num_rejected_blocks"] for rec in records),
        "alpha_before": {k: v["alpha"] for k, v in before.items()},
        "alpha_after": {k: v["alpha"] for k, v in vals[sel].items()},
        "tau_before": {k: v["tau"] for k, v in before.items()},
        "tau_after": {k: v["tau"] for k, v in vals[sel].items()},
        "rounds": [{k: v for k, v in rec.items() if k != "key"} for rec in records],
        "num_val_prompts": num_val,
        "num_train_prompts": num_pool,
        "wall_s": round(time.time() - t0, 1),
    }
    write_json(out / SUMMARY, summary)
    return _result(summary, reused=False)


def _write_log(out: Path, before: dict, records: list[dict]) -> None:
    """logs/metrics.jsonl: each round's train records at global steps, then its refine records."""
    lines, step0 = [_val_record(0, 0, before)], 0
    for rec in records:
        log = out / "rounds" / f"round-{rec['round']}" / "train" / "logs" / "metrics.jsonl"
        for line in log.read_text().splitlines() if log.is_file() else []:
            if line.strip():
                x = json.loads(line)
                lines.append({**x, "step": step0 + x["step"], "round": rec["round"]})
        lines.append(_val_record(rec["step"], rec["round"], rec["validation"]))
        lines.append(
            {
                "step": rec["step"],
                "split": "refine_rollouts",
                "round": rec["round"],
                **{f"before_{k}": v for k, v in rec["replay_before"].items()},
                **{f"after_{k}": v for k, v in rec["replay_after"].items()},
                "rejected_loss_before": rec["rejected_loss_before"],
                "rejected_loss_after": rec["rejected_loss_after"],
            }
        )
        step0 = rec["step"]
    with atomic_path(out / "logs" / "metrics.jsonl") as tmp:
        tmp.write_text("".join(json.dumps(x) + "\n" for x in lines))


def _val_record(step: int, r: int, val: dict) -> dict[str, Any]:
    rec: dict[str, Any] = {"step": step, "split": "refine_val", "round": r}
    for label, v in val.items():
        rec[f"tau_{label}"] = v["tau"]
        rec.update({f"alpha_{label}_{j + 1}": a for j, a in enumerate(v["alpha"])})
    return rec


def _result(summary: dict[str, Any], reused: bool) -> RefineResult:
    s = summary
    return RefineResult(
        out=Path(s["out"]),
        best_dir=Path(s["best_dir"]),
        final_dir=Path(s["final_dir"]),
        checkpoint=Path(s["checkpoint"]),
        num_speculative_tokens=s["num_speculative_tokens"],
        num_rounds=s["num_rounds"],
        selected_round=s["selected_round"],
        num_rollouts=s["num_rollouts"],
        num_rejected_blocks=s["num_rejected_blocks"],
        alpha_before=s["alpha_before"],
        alpha_after=s["alpha_after"],
        tau_before=s["tau_before"],
        tau_after=s["tau_after"],
        rounds=s["rounds"],
        num_val_prompts=s["num_val_prompts"],
        num_train_prompts=s["num_train_prompts"],
        wall_s=s["wall_s"],
        reused=reused,
    )
