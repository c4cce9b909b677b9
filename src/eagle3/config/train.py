"""The draft's configs: its vocabulary (eagle3.vocab), its training (eagle3.train; every setting
but the inputs in the group of the component that reads it, eagle3.config.train_options) and its
on-policy refinement (eagle3.refine)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from eagle3.config.base import (
    ChatTemplateKwargs,
    StageConfig,
    Temperatures,
    TrustRemoteCode,
)
from eagle3.config.capture import AuxLayerIdList, StorageDtype
from eagle3.config.fields import ComputeDtype, Count, LossWeighting, Number
from eagle3.config.train_options import (
    TRAIN_MOVED_KEYS,
    CheckpointOptions,
    DraftOptions,
    LoaderOptions,
    LossOptions,
    OptimizerOptions,
    RuntimeOptions,
    ScheduleOptions,
)


class VocabConfig(StageConfig):
    data: str | None = Field(
        None, description="Prepared dataset dir (token frequencies over loss-masked tokens)"
    )
    out: Path | None = Field(
        None, description="Output directory for vocab.safetensors + coverage.json"
    )
    draft_vocab_size: Count = Field(
        32000, gt=0, description="Number of target tokens the draft can propose"
    )


class TrainConfig(StageConfig):
    """`eagle3 train`: its inputs, the run's length, k and the seed at the top; every other
    setting in the group of the component that reads it (eagle3.train_options)."""

    target: str | None = Field(
        None, description="Target model dir (config, frozen embedding, final norm, lm_head)"
    )
    captured: str | None = Field(
        None,
        description="Capture dir (output of `eagle3 capture`), or several separated by commas "
        "(captures made in parallel on several GPUs/hosts, or of data added later), trained as one "
        "dataset; they must share target, tokenizer, chat template and aux layers",
    )
    vocab: str | None = Field(None, description="Vocab dir (output of `eagle3 vocab`)")
    out: Path | None = Field(None, description="Output dir for checkpoints, logs and curves")
    val_captured: str | None = Field(
        None,
        description="Capture dir of validation prompts (ideally ones the target never trained on); "
        "used instead of the held-out loader.val_fraction split to pick the best checkpoint",
    )
    aux_layer_ids: AuxLayerIdList | None = Field(
        None,
        description="Train on these of the captured aux ids (the last layer's id L is read from "
        "the captured last_hidden_states); default: all captured aux ids. One wide capture then "
        "serves a layer sweep",
    )
    epochs: Number = Field(1.0, gt=0, description="Passes over the training split")
    max_steps: Count | None = Field(
        None, gt=0, description="Stop after this many optimizer steps (overrides epochs)"
    )
    num_speculative_tokens: Count | None = Field(
        None,
        gt=0,
        description="k the draft will be served with: the best checkpoint maximises the validation "
        "τ estimate at k. In a pipeline it is evaluate.num_speculative_tokens (set k there, once); "
        "standalone default 3",
    )
    seed: Count = Field(0, description="Seed for init, shuffling and dropout")
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    allow_target_mismatch: bool = Field(
        False,
        description="Train even though the target's config.json sha256, layer count or "
        "weight files differ from those the capture recorded (a warning instead of an error)",
    )
    loader: LoaderOptions = Field(default_factory=LoaderOptions, description=LoaderOptions.__doc__)
    draft: DraftOptions = Field(default_factory=DraftOptions, description=DraftOptions.__doc__)
    loss: LossOptions = Field(default_factory=LossOptions, description=LossOptions.__doc__)
    optimizer: OptimizerOptions = Field(
        default_factory=OptimizerOptions, description=OptimizerOptions.__doc__
    )
    schedule: ScheduleOptions = Field(
        default_factory=ScheduleOptions, description=ScheduleOptions.__doc__
    )
    checkpoint: CheckpointOptions = Field(
        default_factory=CheckpointOptions, description=CheckpointOptions.__doc__
    )
    runtime: RuntimeOptions = Field(
        default_factory=RuntimeOptions, description=RuntimeOptions.__doc__
    )

    #: keys of earlier versions' flat train section -> their group now (an error names them)
    MOVED_KEYS: ClassVar[dict[str, str]] = TRAIN_MOVED_KEYS

    @model_validator(mode="after")
    def _check_init_layers(self) -> TrainConfig:
        draft = self.draft
        if draft.init_layers_from_target and (draft.num_hidden_layers or 1) < 2:
            raise ValueError(
                "draft.init_layers_from_target=true needs draft.num_hidden_layers >= 2 (got "
                f"{draft.num_hidden_layers or 1}): the first draft layer reads (embedding, "
                "hidden) and has no target counterpart; set --draft-num-hidden-layers 2 or more"
            )
        if draft.init_layers_from_target and draft.family == "eagle3.1":
            raise ValueError(
                "draft.init_layers_from_target=true with draft.family=eagle3.1: fc is initialised "
                "to pass the deepest aux state through unchanged, which EAGLE-3.1's fc_norm would "
                "RMS-normalise away from what the copied target layers expect; use family eagle3 "
                "or set init_layers_from_target: false"
            )
        if self.loss.midlayer_feature_weight > 0 and not draft.init_layers_from_target:
            raise ValueError(
                f"loss.midlayer_feature_weight={self.loss.midlayer_feature_weight} needs "
                "draft.init_layers_from_target=true (the first layer's target is the state the "
                "copied target layers read); set both or neither"
            )
        return self


class RefineOptimizerOptions(OptimizerOptions):
    """Each round's optimizer: train's group, with a lower peak lr (a fresh AdamW every round)."""

    lr: Number = Field(2e-5, gt=0, description="Peak learning rate of each round (below train's)")


class RefineScheduleOptions(ScheduleOptions):
    """Each round's lr schedule (over steps_per_round): train's group, with a short warmup."""

    warmup_steps: Count = Field(10, ge=0, description="Linear warmup steps at each round's start")


class RefineConfig(StageConfig):
    """`eagle3 refine`: on-policy refinement of a trained draft (eagle3.refine). Each round rolls
    the target out on prompts of the training sources, replays the draft's drafting rounds on the
    rollouts as vLLM runs them and trains the draft at the rounds it drafted, up to each first
    rejected token, mixed with supervised batches; a validation split of the same sources
    measures per-position acceptance before and after. A round trains with the checkpoint's own
    training settings (its recorded TrainConfig), except for refine's `optimizer` and `schedule`
    groups (train's groups, with refine's defaults), steps_per_round, and batch_size,
    max_seq_len and loss_weighting where set here."""

    enabled: bool = Field(
        False,
        description="Pipeline only: run this stage between train and export (export then "
        "reads its output)",
    )
    target: str | None = Field(None, description="Target model dir")
    checkpoint: str | None = Field(
        None,
        description="The draft to refine: a training output dir (`eagle3 train --out`: "
        "best/, else final/, else its newest checkpoint) or one checkpoint dir in it",
    )
    data: str | None = Field(
        None,
        description="Prepared dataset dir(s) of the TRAINING sources, comma-separated: the "
        "turns before each first answer are the prompts rolled out (never eval prompts)",
    )
    vocab: str | None = Field(
        None,
        description="Vocab dir (default: the one the checkpoint was trained with; its d2t "
        "must equal the checkpoint's)",
    )
    captured: str | None = Field(
        None,
        description="Capture dir(s) of the supervised data mixed in, comma-separated "
        "(default: the checkpoint's own training capture); unused when supervised_share is 0",
    )
    out: Path | None = Field(
        None,
        description="Output dir, laid out as train's (best/, final/, checkpoints/, "
        "logs/metrics.jsonl) plus rounds/ and validation/",
    )
    backend: Literal["vllm", "hf"] | None = Field(
        None,
        description="Rollouts and their capture: vllm engines, or transformers generate + "
        "forward (hosts without vLLM). Default vllm; in a pipeline the capture section's backend",
    )
    device: str = Field("auto", description="hf backend and training device: auto, cpu, cuda:N")
    dtype: ComputeDtype = Field(
        "auto",
        description="Target compute dtype of the rollouts and their capture (auto: "
        "float32 on CPUs without native bf16, bfloat16 elsewhere)",
    )
    storage_dtype: StorageDtype = Field(
        "bfloat16", description="dtype of the captured rollout states"
    )
    rounds: Count = Field(
        2,
        gt=0,
        description="Rounds of rollout -> replay -> training, each from the last one's "
        "draft; cached by content (a rerun reuses the rounds whose inputs are unchanged)",
    )
    temperatures: Temperatures = Field(
        default_factory=lambda: [0.0, 0.6],
        description="Sampling temperatures of the rollouts, "
        "comma-separated; every prompt is rolled out once at each",
    )
    top_p: Number = Field(
        0.95, gt=0, le=1, description="Nucleus mass of the sampled rollouts (temperature > 0)"
    )
    num_prompts: Count = Field(
        512,
        gt=0,
        description="Training prompts rolled out per round; each round takes fresh "
        "prompts while the data has them (then it wraps around)",
    )
    num_val_prompts: Count = Field(
        64,
        gt=0,
        description="Prompts of the training sources held out of every round and rolled "
        "out once: per-position acceptance before and after each round, and best/'s round",
    )
    max_new_tokens: Count = Field(256, gt=0, description="Longest rollout continuation, in tokens")
    trust_remote_code: TrustRemoteCode = False
    chat_template_kwargs: ChatTemplateKwargs = None
    generate_batch_size: Count = Field(256, gt=0, description="Prompts per generate call")
    capture_batch_tokens: Count = Field(
        8192, gt=0, description="Tokens per capture step (vLLM max_num_batched_tokens / hf batch)"
    )
    num_speculative_tokens: Count | None = Field(
        None,
        gt=0,
        description="k: rounds are replayed with k draft tokens (default: the k in the "
        "checkpoint's train_config, else 3). In a pipeline evaluate.num_speculative_tokens",
    )
    steps_per_round: Count = Field(100, gt=0, description="Optimizer steps per round")
    batch_size: Count | None = Field(
        None, gt=0, description="Packed sequences per micro-batch (default: the checkpoint's)"
    )
    max_seq_len: Count | None = Field(
        None,
        gt=0,
        description="Packed sequence length (default: the checkpoint's); prompts "
        "longer than it minus max_new_tokens are not rolled out",
    )
    supervised_share: Number = Field(
        0.5,
        ge=0,
        lt=1,
        description="Share of the micro-batches drawn from the supervised "
        "capture (the plain TTT loss on every row) so that nothing is forgotten; the others are "
        "rollout batches",
    )
    loss_rows: Literal["rounds", "all"] = Field(
        "rounds",
        description="rounds: on a rollout, the loss at the drafting rounds vLLM would "
        "run with this draft (each round's steps up to and including its first rejected token; "
        "the next round starts at that token); all: every row and step (plain TTT on rollouts)",
    )
    rejected_weight: Number = Field(
        1.0,
        gt=0,
        description="Loss weight of each replayed round's first rejected step, "
        "relative to the accepted steps before it",
    )
    loss_weighting: LossWeighting = Field(
        "uniform", description="As train.loss.weighting, for the rounds' steps"
    )
    seed: Count = Field(0, description="Seed of the prompt split, the sampled rollouts, the order")
    allow_target_mismatch: bool = Field(
        False,
        description="Refine even though the target's config or embedding/norm/lm_head "
        "weights differ from those the draft was trained with (a warning instead of an error)",
    )
    optimizer: RefineOptimizerOptions = Field(
        default_factory=RefineOptimizerOptions, description=RefineOptimizerOptions.__doc__
    )
    schedule: RefineScheduleOptions = Field(
        default_factory=RefineScheduleOptions, description=RefineScheduleOptions.__doc__
    )

    #: keys of earlier versions -> their group now (an error names them)
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        key: TRAIN_MOVED_KEYS[key] for key in ("lr", "warmup_steps", "schedule")
    }
