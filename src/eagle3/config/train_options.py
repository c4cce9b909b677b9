"""The train stage's settings, one group per component of the trainer: each group is a nested
section of `train:` (`train.optimizer.lr`) and `--group-field` flags (`--optimizer-lr`), and the
component reads its group, not the whole TrainConfig.

    loader      the batches: packed length, rows per step, the validation split, how the capture
                is read (eagle3.train.data.PackedLoader, eagle3.train.trainer.build_run)
    draft       the draft family and its shape, its initialisation, what stays frozen
                (eagle3.model: the family registry; eagle3.train.trainer.build_draft)
    loss        the training-time-test loss (eagle3.train.step.ttt_forward, eagle3.train.loss)
    optimizer   AdamW and the step's guards (eagle3.train.loop.build_optimizer)
    schedule    the lr's warmup and decay (eagle3.train.loop.lr_lambda)
    checkpoint  when the run logs, validates and saves, what a save holds, resume
                (eagle3.train.loop.train_loop, eagle3.train.checkpoint)
    runtime     how the steps run: parallelism, precision, attention kernel, compilation
                (eagle3.train.parallel, eagle3.train.attention)

The inputs (target, captured, vocab, out, val_captured, aux_layer_ids), the run's length
(epochs, max_steps), k, the seed and the device stay at the top of TrainConfig
(eagle3.config.train).

Why here and not inside eagle3/train/: eagle3.config, in the bottom import layer, composes these
groups into TrainConfig (and RefineConfig into its own), and a module may not import a layer above
its own (pyproject.toml's library-layers); this module sits in the config package and imports
nothing of eagle3 but eagle3.config.fields
(docs/decisions/0020-config-groups-and-draft-families.md).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from eagle3.config.fields import Count, Decay, LossWeighting, Number, OptionGroup


class LoaderOptions(OptionGroup):
    """The batches: packed length, rows per optimizer step, the validation split, how the capture
    is read."""

    max_seq_len: Count = Field(
        2048, gt=0, description="Packed sequence length (document-aware packing)"
    )
    batch_size: Count = Field(1, gt=0, description="Packed sequences per micro-batch")
    grad_accum: Count = Field(1, gt=0, description="Micro-batches per optimizer step")
    val_fraction: Number = Field(
        0.05,
        ge=0,
        lt=1,
        description="Fraction of samples held out for validation (ignored for validation when "
        "val_captured is set)",
    )
    hidden_noise: Number = Field(
        0.0,
        ge=0,
        description="Std of Gaussian noise added to the aux states in training, relative to each "
        "state's RMS",
    )
    num_workers: Count = Field(
        2,
        ge=1,
        description="Threads packing training batches ahead of the step, a whole batch each (a "
        "small draft on a fast GPU outruns one thread); the train log's loader_wait_frac is the "
        "share of the wall time spent waiting",
    )
    preload: bool = Field(
        False,
        description="Read the capture into RAM once (sequential shard reads, only the trained "
        "layers kept) instead of memory-mapping it per sample; for captures that fit in RAM",
    )
    verify_capture: bool = Field(
        True,
        description="Check every capture shard's sha256 against its manifest before training "
        "(local rank 0 reads the capture once per host, in parallel threads); a corrupt capture is "
        "refused, naming the shards",
    )


#: DraftOptions fields that shape the draft (eagle3.model.draft.draft_config_from_target reads
#: them); the others say how it starts and what trains
DRAFT_SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
    "num_hidden_layers",
)

#: the EAGLE-3.1 switches of earlier versions -> the field that chooses EAGLE-3.1 now
DRAFT_MOVED_KEYS = {"fc_norm": "family", "norm_output": "family"}


class DraftOptions(OptionGroup):
    """The draft: its family, its dimensions (unset: derived from the target's config), how it
    starts and what stays frozen."""

    family: str = Field(
        "eagle3",
        description="Draft family, by its registered name: eagle3 (EAGLE-3) or eagle3.1 "
        "(EAGLE-3.1: one RMSNorm per aux state before fc, the next step reads the final norm's "
        "output); eagle3.model.family_names() lists them",
    )
    hidden_size: Count | None = Field(
        None,
        description="Draft hidden size (default: the target's; vLLM's EAGLE-3 "
        "reads the target's embedding, so it must equal the target's)",
    )
    intermediate_size: Count | None = Field(
        None,
        description="Draft MLP width (default: the target's); a wider "
        "one-layer draft costs more per draft step (see `evaluate`'s cost ratio)",
    )
    num_attention_heads: Count | None = Field(
        None, description="Draft attention heads (default: the target's)"
    )
    num_key_value_heads: Count | None = Field(
        None, description="Draft KV heads (default: the target's)"
    )
    head_dim: Count | None = Field(None, description="Draft head dim (default: the target's)")
    max_position_embeddings: Count | None = Field(
        None, description="Longest position (default: the target's)"
    )
    rope_theta: Number | None = Field(None, description="RoPE base (default: the target's)")
    rms_norm_eps: Number | None = Field(None, description="RMSNorm epsilon (default: the target's)")
    num_hidden_layers: Count | None = Field(
        None, ge=1, description="Draft decoder layers (default 1, as EAGLE-3)"
    )
    dropout: Number = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on each draft layer's attention and MLP outputs in training",
    )
    init_head_from_target: bool = Field(
        False, description="Start lm_head (draft-vocab rows) and the final norm from the target's"
    )
    init_layers_from_target: bool = Field(
        False,
        description="Start the draft's decoder layers after the first (layers.1..n-1) from the "
        "target's top n-1 layers, fc from the deepest aux state and the first layer as the "
        "identity on the residual stream, so training begins from the target's own computation "
        "(needs draft.num_hidden_layers >= 2 and a dense Llama-style target: plain attention, "
        "SwiGLU MLP)",
    )
    freeze: list[str] = Field(
        default_factory=list,
        description="Draft parameters kept fixed, by name prefix (fc, midlayer, layers, "
        "layers.2, norm, lm_head): e.g. the layers copied by init_layers_from_target and the head "
        "from the target",
    )

    MOVED_KEYS: ClassVar[dict[str, str]] = DRAFT_MOVED_KEYS
    MOVED_NOTE: ClassVar[str] = (
        "EAGLE-3.1, fc_norm and norm_output on, is the draft family eagle3.1 now"
    )

    @field_validator("freeze", mode="before")
    @classmethod
    def _parse_freeze(cls, v: Any) -> Any:
        return [x.strip() for x in v.split(",") if x.strip()] if isinstance(v, str) else v

    def shape(self) -> dict[str, Any]:
        """The dimensions set here (the rest are the target's)."""
        return {k: getattr(self, k) for k in DRAFT_SHAPE_FIELDS if getattr(self, k) is not None}


class LossOptions(OptionGroup):
    """The training-time-test loss: how deep the draft is unrolled and how its steps and rows
    weigh."""

    ttt_steps: Count = Field(7, gt=0, description="Training-time-test unroll depth K")
    decay: Number = Field(0.8, gt=0, le=1, description="Weight of TTT step j is decay**j")
    weighting: LossWeighting = Field(
        "uniform",
        description="uniform: every supervised row of TTT step j weighs the same; "
        "accept_until_fail: row t of step j weighs the draft's own probability (detached) of "
        "having drafted the target's tokens at steps < j there, i.e. of step j being reached in a "
        "greedy round (each step's CE is still divided by its row count, so later steps weigh "
        "less overall). Validation is unweighted",
    )
    supervise: Literal["assistant", "all"] = Field(
        "assistant",
        description="Training rows whose target distribution the draft learns: assistant tokens "
        "(the loss mask from prepare) or all tokens, prompts too (more signal from the same "
        "conversations); validation always scores assistant tokens",
    )
    distill_temperature: Number = Field(
        1.0,
        gt=0,
        description="Divide draft and target logits by this before the soft cross-entropy: < 1 "
        "sharpens the target towards its argmax (what greedy acceptance checks), > 1 softens it",
    )
    copy_weight: Number = Field(
        1.0,
        gt=0,
        description="Loss weight of the rows whose token continues a span repeated earlier in its "
        "document (the 3-gram ending at it occurred before: where prompt lookup drafts the right "
        "token), relative to the other rows'; > 1 teaches the draft to copy the context where a "
        "greedy target repeats itself. Validation is unweighted",
    )
    feature_weight: Number = Field(
        0.0,
        ge=0,
        description="Weight of a feature-regression term (EAGLE-1): per TTT step, the mean squared "
        "error between the RMS-normalised hidden the draft passes on and the target's "
        "RMS-normalised last hidden state at the same row; more signal per row than the token "
        "distribution alone, for small training sets",
    )
    midlayer_feature_weight: Number = Field(
        0.0,
        ge=0,
        description="With draft.init_layers_from_target: weight of the same regression for the "
        "first layer's output against the deepest aux state at the next row, the input the "
        "target's copied layers expect there (needs the deepest aux id = L - draft layers + 1, "
        "e.g. 5 for 4 draft layers on an 8-layer target)",
    )


class OptimizerOptions(OptionGroup):
    """AdamW, gradient clipping and the guard against non-finite steps."""

    lr: Number = Field(1e-4, gt=0, description="Peak learning rate")
    weight_decay: Number = Field(0.0, description="AdamW weight decay")
    beta1: Number = Field(0.9, description="AdamW beta1")
    beta2: Number = Field(0.95, description="AdamW beta2")
    grad_clip: Number = Field(0.5, description="Max grad norm (0 disables)")
    max_nonfinite_steps: Count = Field(
        0,
        ge=0,
        description="Optimizer steps whose batch, loss or gradient is non-finite (NaN/inf) that "
        "are skipped (counted in the log) before training stops with an error naming the shard, "
        "sample and step; 0 = stop at the first",
    )


class ScheduleOptions(OptionGroup):
    """The learning rate over the run: a linear warmup, then a decay to min_lr_ratio x lr at the
    run's last step (its length: epochs, max_steps)."""

    warmup_steps: Count = Field(50, ge=0, description="Linear warmup steps")
    decay: Decay = Field("cosine", description="Decay after warmup")
    min_lr_ratio: Number = Field(0.1, description="Final lr as a fraction of the peak")


class CheckpointOptions(OptionGroup):
    """When the run logs, validates and saves; what a save holds; resume."""

    log_every: Count = Field(10, gt=0, description="Log train metrics every N optimizer steps")
    eval_every: Count = Field(
        200, gt=0, description="Validate every N optimizer steps (and at the end)"
    )
    save_every: Count = Field(
        500, gt=0, description="Checkpoint every N optimizer steps (and at the end)"
    )
    keep: Count = Field(
        3,
        ge=0,
        description="Keep the newest N checkpoints/step-* dirs plus the one with the best "
        "validation tau estimate; older ones are deleted as new ones are written (each holds the "
        "weights and the optimizer state: ~18 GB for a Kimi-K2.5 draft). best/ and final/ are "
        "separate and always kept. 0 keeps every checkpoint",
    )
    ema_decay: Number = Field(
        0.0,
        ge=0,
        lt=1,
        description="Keep an exponential moving average of the weights with this decay (e.g. "
        "0.999); validation, best/, final/ and checkpoints' model.safetensors then hold the "
        "average (the raw weights resume from raw.safetensors). 0 = off",
    )
    resume: bool = Field(
        True, description="Resume from the latest checkpoint in --out when present"
    )
    force_resume: bool = Field(
        False,
        description="Resume even though settings that may change mid-run differ from the "
        "checkpoint's (lr, schedule, warmup, epochs, max_steps, ttt_steps, batch shape, loss "
        "weights, dropout, ...): a warning lists them and the new values apply from the resumed "
        "step. Never over another capture, vocab, target, draft shape, aux ids, seed, "
        "val_fraction, freeze or parallel mode (eagle3.train.resume_inputs)",
    )


class RuntimeOptions(OptionGroup):
    """How the steps run: parallelism over GPUs, precision, the attention kernel, compilation."""

    parallel: Literal["auto", "ddp", "fsdp2", "fsdp"] = Field(
        "auto",
        description="Under torchrun: ddp replicates the draft on every GPU; fsdp2 shards its "
        "weights, gradients and AdamW state over the GPUs (torch FSDP2 fully_shard), for drafts "
        "whose replicas do not fit; auto = fsdp2 when the trainable weights + gradients + AdamW "
        "state (16 B per parameter) exceed a quarter of one GPU's memory, else ddp. fsdp is read "
        "as fsdp2. One process: neither",
    )
    dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="Autocast dtype on GPU (CPU trains in float32 unless bfloat16 is forced)",
    )
    attention: Literal["auto", "flex", "sdpa", "naive"] = Field(
        "auto", description="TTT attention kernel"
    )
    compile: bool = Field(False, description="torch.compile the draft step")
    compile_cache: str | None = Field(
        None,
        description="Directory for torch.compile's caches (inductor graphs, autotuning, Triton "
        "kernels; TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point into it while training). Keep "
        "it, or copy it to the next machine (same GPU type and software), and that run's first "
        "step skips the compile: two fresh H200s, 51 s -> 6 s. A path to an existing FILE is read "
        "and rewritten as a torch.compiler.save_cache_artifacts bundle (earlier versions' format)",
    )

    @field_validator("parallel", mode="after")
    @classmethod
    def _fsdp_is_fsdp2(cls, v: str) -> str:
        return "fsdp2" if v == "fsdp" else v


#: group name -> its class, in the order they appear in TrainConfig
TRAIN_GROUPS: dict[str, type[OptionGroup]] = {
    "loader": LoaderOptions,
    "draft": DraftOptions,
    "loss": LossOptions,
    "optimizer": OptimizerOptions,
    "schedule": ScheduleOptions,
    "checkpoint": CheckpointOptions,
    "runtime": RuntimeOptions,
}

#: the names a field had before it sat in a group, where they differ from its name in the group
_OLD_NAMES = {
    "schedule.decay": "schedule",
    "loss.decay": "loss_decay",
    "loss.weighting": "loss_weighting",
    "loss.feature_weight": "feature_loss_weight",
    "loss.midlayer_feature_weight": "midlayer_feature_loss_weight",
    "checkpoint.keep": "keep_checkpoints",
    "loader.num_workers": "num_loader_workers",
}

#: a TrainConfig key of earlier versions (one flat section) -> its place in a group now
TRAIN_MOVED_KEYS: dict[str, str] = {
    _OLD_NAMES.get(f"{group}.{name}", name): f"{group}.{name}"
    for group, cls in TRAIN_GROUPS.items()
    for name in cls.model_fields
    if group != "draft" or name not in DRAFT_SHAPE_FIELDS + ("family",)
}


def nest_train_record(record: dict[str, Any]) -> dict[str, Any]:
    """A TrainConfig as earlier versions recorded it (one flat mapping: a checkpoint's
    `train_config`) in the groups of this one; a record already in groups is returned as is.
    EAGLE-3.1's switches (draft.fc_norm / draft.norm_output) become draft.family eagle3.1."""
    out = dict(record)
    flat = {  # `schedule: cosine` is an old key, `schedule: {...}` a group
        old: out.pop(old)
        for old in TRAIN_MOVED_KEYS
        if old in out and not (old in TRAIN_GROUPS and isinstance(out[old], dict))
    }
    for old, value in flat.items():
        group, name = TRAIN_MOVED_KEYS[old].split(".")
        out[group] = {name: value, **out.get(group, {})}
    draft = out.get("draft")
    if isinstance(draft, dict) and any(k in draft for k in DRAFT_MOVED_KEYS):
        draft = dict(draft)
        switches = [bool(draft.pop(k, False)) for k in DRAFT_MOVED_KEYS]
        draft.setdefault("family", "eagle3.1" if any(switches) else "eagle3")
        out["draft"] = draft
    return out
