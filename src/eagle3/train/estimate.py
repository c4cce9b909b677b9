"""Offline acceptance estimate: run a trained draft's TTT unroll over captured states, no vLLM.

    est = estimate_acceptance(EstimateConfig(draft="runs/x/draft", captured="runs/val/captured",
                                             target=T))
    est.tau  # 1 + accepted / rounds from replayed greedy drafting rounds, as vLLM counts them

Step j reads the draft's own output of step j-1, as in vLLM's drafting loop. `tau` replays rounds
the way the engine runs them (replay_rounds: a round accepting n tokens moves the next one n+1
tokens on); `tau_per_row` makes every supervised row a round start and overstates τ, because rounds
crowd where the draft fails. On refbench the replayed value was 2.307 vs vLLM's 2.287
(benchmarks/results/history/2026-11-30-refbench-estimator-vs-vllm.md). The trainer picks its best
checkpoint with it; prompts the target never trained on make the best validation set.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file

from eagle3.acceptance import simulate_acceptance_length
from eagle3.artifacts import CaptureManifest, DraftMetadata
from eagle3.config import DEFAULT_NUM_SPECULATIVE_TOKENS, ConfigError, Count
from eagle3.model.draft import DraftConfig, text_config
from eagle3.model.family import DraftModel, get_family
from eagle3.train.checkpoint import METADATA, WEIGHTS
from eagle3.train.data import SelectedLayers, eval_batches, load_samples
from eagle3.train.loss import TargetHead
from eagle3.train.step import STAT_COLUMNS, PackedBatch, TTTModule, summarize
from eagle3.weights import load_target_tensors, read_target_config


@dataclass
class Estimate:
    tau: float  # replayed rounds: 1 + accepted / rounds, as vLLM counts (see replay_rounds)
    tau_per_row: float  # 1 + sum_{j<k} prod_{i<=j} cond_acc_i (every supervised row a round start)
    accepted_per_position: list[int]
    num_rounds: int
    num_speculative_tokens: int
    acc: list[float]  # per TTT step: top-1 agreement with the target's greedy token
    cond_acc: list[float]  # per TTT step: agreement given every earlier step agreed
    num_samples: int
    metrics: dict[str, float] = field(default_factory=dict)


def tau_from_metrics(metrics: dict[str, float], k: int) -> float:
    """1 + sum_{j<k} prod_{i<=j} cond_acc_i from summarize()'s per-step metrics (every row a round
    start)."""
    return simulate_acceptance_length([metrics[f"cond_acc_{j}"] for j in range(k)])


@dataclass
class RoundCounts:
    """Greedy speculative decoding replayed over documents: what vLLM's counters would show."""

    num_rounds: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, other: RoundCounts) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * len(other.accepted_per_position)
        self.num_rounds += other.num_rounds
        self.accepted_per_position = [
            a + b
            for a, b in zip(self.accepted_per_position, other.accepted_per_position, strict=True)
        ]

    @property
    def tau(self) -> float:
        return 1.0 + sum(self.accepted_per_position) / max(self.num_rounds, 1)

    def acceptance_per_position(self) -> list[float]:
        """α at draft positions 1..k: the share of the rounds that reached position j (accepted
        j-1 tokens) which accepted its token too (the per-position acceptance docs/history/
        reports; vLLM's own per-position rate divides by every round instead)."""
        accepted = self.accepted_per_position
        reached = [self.num_rounds, *accepted[:-1]]
        return [a / r if r else 0.0 for a, r in zip(accepted, reached, strict=True)]


def replay_rounds(
    correct: torch.Tensor,
    valid: torch.Tensor,
    doc: torch.Tensor,
    k: int,
    max_new_tokens: int | None = None,
) -> RoundCounts:
    """Replay greedy drafting rounds of k tokens over each document's supervised span
    (iter_rounds), counted."""
    counts = RoundCounts(0, [0] * k)
    for _, _, n in iter_rounds(correct, valid, doc, k, max_new_tokens):
        counts.num_rounds += 1
        for j in range(n):
            counts.accepted_per_position[j] += 1
    return counts


def iter_rounds(
    correct: torch.Tensor,
    valid: torch.Tensor,
    doc: torch.Tensor,
    k: int,
    max_new_tokens: int | None = None,
) -> Iterator[tuple[int, int, int]]:
    """(batch row b, round-start row t, tokens accepted n in 0..k) of every drafting round of k
    tokens that vLLM runs over each document's supervised span, in order; n < k means draft
    position n+1 (row t's step n) was the first rejected one.

    correct, valid: (K>=k, B, T) from ttt_forward(return_correct=True); doc: (B, T). Row t drafts
    tokens t+2..t+1+k. The first round sits one row after the first supervised row (vLLM drafts only
    after the target's prefill produced the first answer token); a round accepting n tokens moves
    the next one n+1 rows on (the accepted tokens plus the target's bonus token). Unlike the per-row
    average (every row a round start), rounds then crowd where the draft fails, as in the engine,
    which is why this tracks vLLM's τ more closely. One host copy per call, then Python over the
    rounds (not the rows).
    """
    ok = (correct[:k] & valid[:k]).cpu().tolist()  # (k, B, T) python lists: fast scalar access
    v0, docs = valid[0].cpu().tolist(), doc.cpu().tolist()  # (B, T)
    for b in range(len(docs)):
        first_row: dict[int, int] = {}
        for r, is_valid in enumerate(v0[b]):
            if is_valid:
                first_row.setdefault(docs[b][r], r)
        for d, r0 in first_row.items():
            t = start = r0 + 1
            while t < len(docs[b]) and docs[b][t] == d and v0[b][t]:
                if max_new_tokens is not None and t - start + 1 >= max_new_tokens:
                    break
                n = 0
                while n < k and ok[n][b][t]:
                    n += 1
                yield b, t, n
                t += n + 1


@torch.no_grad()
def score_batches(
    ttt: torch.nn.Module,
    batches: list[PackedBatch],
    head: TargetHead,
    *,
    steps: int,
    device,
    dtype: torch.dtype,
    replay_k: int | None = None,
    max_new_tokens: int | None = None,
    **kw,
) -> dict[str, float]:
    """Summed TTT stats over `batches` (eval mode, autocast to `dtype` on GPU) -> summarize()'s
    metrics; with `replay_k`, also `tau_replay` and `accepted_<j>`/`num_rounds` from
    replay_rounds()."""
    was_training = ttt.training
    ttt.eval()
    stats = torch.zeros(steps, len(STAT_COLUMNS), device=device)  # (K, len(STAT_COLUMNS))
    rounds = RoundCounts()
    on_gpu = torch.device(device).type == "cuda"
    with torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32):
        for b in batches:
            b = b.to(device, dtype if on_gpu else torch.float32)
            out = ttt(b, head, steps=steps, return_correct=replay_k is not None, **kw)
            stats += out[1]
            if replay_k is not None:
                rounds.add(replay_rounds(out[2], out[3], b.doc_ids, replay_k, max_new_tokens))
    ttt.train(was_training)
    m = summarize(stats)
    if replay_k is not None:
        m["tau_replay"] = rounds.tau
        m["num_rounds"] = float(rounds.num_rounds)
        m.update({f"accepted_{j}": float(a) for j, a in enumerate(rounds.accepted_per_position)})
    return m


def load_draft_dir(path: str | Path, target: str | Path) -> tuple[DraftModel, DraftMetadata]:
    """The draft in a training output (best/, final/, a checkpoint) or an exported vLLM-format
    dir, built by its family (eagle3.model.family)."""

    path = Path(path)
    if not (path / METADATA).is_file():
        raise ConfigError(
            f"draft={path}: no {METADATA}; pass a directory written by `eagle3 train` or `eagle3 "
            "export`"
        )
    meta = DraftMetadata.load(path)
    dcfg = DraftConfig.from_dict(meta.draft_config)
    model = get_family(dcfg.family).build(dcfg)
    sd = load_file(str(path / WEIGHTS))
    if "d2t" not in sd:  # full-vocab vLLM export: lm_head rows already in target order
        sd["d2t"] = torch.zeros(model.cfg.draft_vocab_size, dtype=torch.long)
        sd["t2d"] = torch.ones(model.cfg.vocab_size, dtype=torch.bool)
    own = model.state_dict()
    missing, _ = model.load_state_dict(
        {k: v.to(own[k].dtype) for k, v in sd.items() if k in own}, strict=False
    )
    unexpected = sorted(set(sd) - set(own))
    missing = [k for k in missing if not k.startswith("embed_tokens.")]
    if missing or unexpected:
        raise ConfigError(
            f"draft={path}/{WEIGHTS}: missing keys {missing}, unexpected keys {unexpected}"
        )
    with torch.no_grad():
        model.embed_tokens.weight.copy_(load_target_tensors(target)["embed"].float())
    return model, meta


class EstimateConfig(BaseModel):
    """`eagle3 estimate`: offline τ of a trained draft on captured prompts (no vLLM)."""

    model_config = ConfigDict(extra="forbid")
    draft: Path = Field(
        ...,
        description="Draft dir: `eagle3 export` output or a training best/, final/ or checkpoint "
        "dir",
    )
    captured: Path = Field(
        ...,
        description="Capture dir of held-out prompts (ideally ones the target never trained "
        "on), or several comma-separated; it must hold the draft's aux layers",
    )
    target: Path = Field(
        ..., description="Target model dir (frozen embedding, final norm and lm_head)"
    )
    num_speculative_tokens: Count | None = Field(
        None,
        gt=0,
        description="k, the draft tokens per round (default: the k the draft was trained for, "
        "recorded in its eagle3_draft.json train_config; 3 when it records none)",
    )
    max_new_tokens: Count | None = Field(
        128,
        gt=0,
        description="Replay only the first N answer tokens (refbench "
        "evaluates 128); unset = whole answers",
    )
    max_seq_len: Count = Field(2048, gt=0, description="Packed sequence length")
    batch_size: Count = Field(4, gt=0, description="Packed sequences per forward")
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    attention: Literal["auto", "flex", "sdpa", "naive"] = Field(
        "auto", description="TTT attention kernel"
    )


def load_for_replay(
    draft: str | Path, captured: str | Path, target: str | Path
) -> tuple[DraftModel, DraftMetadata, SelectedLayers, TargetHead]:
    """What a replay of `draft` over a capture needs (on the CPU, float32): the draft and its
    metadata, the captured samples at the draft's aux layers, and the target's head over the draft
    vocabulary."""
    model, meta = load_draft_dir(draft, target)
    manifest = CaptureManifest.load_combined(captured)
    tensors = load_target_tensors(target)
    tc = text_config(read_target_config(target))
    try:
        samples = SelectedLayers(
            load_samples(captured),
            manifest.aux_layer_ids,
            meta.aux_layer_ids,
            tc["num_hidden_layers"],
        )
    except ValueError as e:
        raise ConfigError(f"captured={captured} cannot feed draft={draft}: {e}") from None
    head = TargetHead(
        tensors["norm"],
        tc.get("rms_norm_eps", 1e-6),
        tensors["lm_head"],
        torch.arange(model.cfg.draft_vocab_size) + model.d2t,
    )
    return model, meta, samples, head


def estimate_acceptance(cfg: EstimateConfig) -> Estimate:
    device = (
        ("cuda" if torch.cuda.is_available() else "cpu") if cfg.device == "auto" else cfg.device
    )
    model, meta, samples, head = load_for_replay(cfg.draft, cfg.captured, cfg.target)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    head = head.to(device, dtype)
    batches = eval_batches(samples, list(range(len(samples))), cfg.max_seq_len, cfg.batch_size)
    k = (
        cfg.num_speculative_tokens
        or meta.trained_num_speculative_tokens
        or DEFAULT_NUM_SPECULATIVE_TOKENS
    )
    m = score_batches(
        TTTModule(model).to(device),
        batches,
        head,
        steps=k,
        device=device,
        dtype=dtype,
        attention=cfg.attention,
        replay_k=k,
        max_new_tokens=cfg.max_new_tokens,
    )
    return Estimate(
        tau=m["tau_replay"],
        tau_per_row=tau_from_metrics(m, k),
        accepted_per_position=[int(m[f"accepted_{j}"]) for j in range(k)],
        num_rounds=int(m["num_rounds"]),
        num_speculative_tokens=k,
        acc=[m[f"acc_{j}"] for j in range(k)],
        cond_acc=[m[f"cond_acc_{j}"] for j in range(k)],
        num_samples=len(samples),
        metrics=m,
    )
