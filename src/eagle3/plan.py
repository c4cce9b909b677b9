"""`eagle3 plan`: how much disk, capture time and training GPU-time a pipeline config needs on some
hardware, and which capture mode fits the disk — before anything runs.

    res = run_plan(PlanConfig(config="configs/kimi-k2.5.yaml",
                              target_config="configs/targets/kimi-k2.5.json",
                              hardware="b300", num_samples=100_000, mean_tokens=1500))
    print(format_plan(res))

Where the numbers come from:
  storage   exact: eagle3.shards.bytes_per_token (aux layers + last layer, storage dtype, ids, mask,
            fp8 scales) x samples x mean tokens/sample (flags, else the prepared manifest under
            work_dir).
  capture   measured: capture_throughput.json (eagle3/assets/measured, from benchmarks/results)
            (capture tokens/s of the refbench target on the 2-core CPU, and capture / plain-prefill
            overhead). GPU profiles: the target's prefill FLOPs/token (eagle3.flops, MoE-active and
            MLA aware) at the fraction of the datasheet bf16 rate that the measured H200 training
            step reaches, times the profile's TFLOP/s ratio to the H200, capped by the
            tensor-parallel all-reduce traffic over the profile's interconnect.
  training  measured: train_step.json (eagle3/assets/measured) (H200 tokens/s of a Llama-8B-like
            draft), scaled by the draft's FLOPs/token (eagle3.flops.count_train_flops at
            train.loader.max_seq_len, train.loss.ttt_steps) and the profile's TFLOP/s ratio to
            the H200; data-parallel scaling assumed linear (not measured yet).
  regenerate modelled: one decode step of the batch the KV room allows, priced by the step-time
            model (eagle3.step_time: weights and routed experts read, KV, all-reduces, a fixed
            time per pass; hardware figures and their sources in eagle3.hardware).
  speculation  after `eagle3 evaluate`: every measured method's speed-up per k and concurrency on
            this hardware (eagle3.speedup), from evaluate's results.json and the same step model.
Every estimate is a first-order model: the JSON carries the anchors and the ratios used, so it can
be checked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, ValidationError

from eagle3.artifacts import EvalResults, PreparedMeta, RoutingStats
from eagle3.config import (
    AuxLayerIds,
    ConfigError,
    Count,
    Number,
    StageConfig,
    StorageDtype,
    format_validation_error,
    load_pipeline_config,
)
from eagle3.console import format_bytes
from eagle3.flops import (
    count_draft_params,
    count_target_forward_flops,
    count_target_params,
    count_train_flops,
    draft_dims,
    kv_cache_bytes_per_token,
)
from eagle3.hardware import HARDWARE, HardwareName, HardwareProfile
from eagle3.io import read_json
from eagle3.speedup import predict_from_row, serving_tensor_parallel_size
from eagle3.step_time import (
    MeasuredRouting,
    draft_weights,
    kv_bytes_per_token_per_gpu,
    predict_pass_time_s,
)

if TYPE_CHECKING:
    from eagle3.shards import StorageEstimate

#: the measured figures every estimate scales from, shipped as package data (copies of
#: benchmarks/results/ capture_throughput.json and train_step.json; tests/test_plan.py checks they
#: match the repository's)
RESULTS_DIR = Path(__file__).resolve().parent / "assets" / "measured"

#: dense bf16 datasheet rate of the H200 the measured figures ran on: the unit of every GPU ratio
H200_BF16_TFLOPS = 989.4

#: shape of the target the CPU capture throughput was measured on
#: (../shared/refbench/target-a-llama/config.json; tests/test_plan.py checks it against the file
#: when refbench is present)
REFBENCH_TARGET = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 8192,
    "tie_word_embeddings": False,
}


class PlanConfig(StageConfig):
    """`eagle3 plan` (every field is a flag, as for the stages); estimates only, not a pipeline
    stage."""

    config: str | None = Field(
        None, description="Pipeline YAML to plan (target, prepare/capture/train/stream sections)"
    )
    target_config: str | None = Field(
        None,
        description="The target's config.json or model dir (default: the config's target; "
        "config-only shapes of the preset targets are in configs/targets/)",
    )
    hardware: HardwareName = Field(
        "h200",
        description="Hardware profile (eagle3.hardware.HARDWARE; sources in docs/scaling.md)",
    )
    num_gpus: Count | None = Field(
        None, gt=0, description="GPUs on the machine (default: the profile's)"
    )
    disk_tb: Number | None = Field(
        None, gt=0, description="Local disk for captures, TB = 1e12 bytes (default: the profile's)"
    )
    num_samples: Count | None = Field(
        None,
        gt=0,
        description="Samples to capture (default: the prepared manifest, else the config's limit)",
    )
    mean_tokens: Number | None = Field(
        None, gt=0, description="Mean tokens per sample (default: the prepared manifest)"
    )
    storage_dtype: StorageDtype | None = Field(
        None, description="Storage dtype of the states (default: capture.storage_dtype)"
    )
    target_weight_bits: Count | None = Field(
        None,
        gt=0,
        description="Bits per target weight in GPU memory (default: the config's "
        "quantization_config, else 16)",
    )
    epochs: Number | None = Field(None, gt=0, description="Training epochs (default: train.epochs)")
    results_dir: str | None = Field(
        None,
        description="Dir of capture_throughput.json + train_step.json to scale from (default: the "
        "figures shipped with eagle3, eagle3/assets/measured; a repository checkout's "
        "benchmarks/results after a new measurement)",
    )
    format: Literal["table", "json"] = Field(
        "table", description="table: human-readable; json: the PlanResult"
    )


@dataclass
class RateEstimate:
    tokens_per_s: float  # the whole machine
    hours: float  # wall-clock
    gpu_hours: float  # hours x GPUs used
    bound: str  # what limits the rate
    basis: str  # the measured figure and the scaling applied


@dataclass
class PlanResult:
    config: str
    target_config: str
    hardware: dict[str, Any]
    num_samples: int
    mean_tokens: float
    sample_source: str
    aux_layer_ids: list[int]
    storage: StorageEstimate
    storage_fp8_bytes: int
    storage_bf16_bytes: int
    disk_bytes: int
    disk_reserve_bytes: int
    mode: str  # offline | streaming
    mode_reason: str
    spool_cap_bytes: (
        int | None
    )  # streaming: the recommended bound on captured-but-not-yet-trained states
    target_params: int
    target_active_params: int
    target_flops_per_token: float
    target_weight_bits: int
    weights_per_gpu_bytes: float
    weights_fit: bool
    capture_tensor_parallel_size: int
    capture: RateEstimate
    draft_params: int
    draft_flops_per_token: float
    epochs: float
    train_tokens: float
    train: RateEstimate
    train_read_bytes_per_s: float
    anchors: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    #: the target writing the training answers (regenerate), modelled; None when regenerate is
    #: off or the profile has no GPU
    regenerate: RateEstimate | None = None
    regenerate_tokens: float | None = None
    #: the evaluated draft's (and compared methods') predicted speed-up per k and concurrency on
    #: this hardware (eagle3.speedup, from evaluate's results.json); None before an evaluation
    predicted_speedup: dict[str, Any] | None = None


# --------------------------------------------------------------------------------- measured anchors


def load_anchors(results_dir: str | Path, storage_dtype: str) -> dict[str, Any]:
    """The measured figures every estimate scales from (file, key, value), with the FLOP rates they
    imply."""
    rdir = Path(results_dir)
    cap_p, train_p = rdir / "capture_throughput.json", rdir / "train_step.json"
    for p in (cap_p, train_p):
        if not p.is_file():
            raise ConfigError(
                f"PlanConfig.results_dir = {str(rdir)!r}: {p.name} is missing; point --results-dir "
                "at a dir holding both (benchmarks/results of a repository checkout)"
            )
    return {"capture": _capture_anchor(cap_p, storage_dtype), "train": _train_anchor(train_p)}


def _capture_anchor(cap_p: Path, storage_dtype: str) -> dict[str, Any]:
    """The measured capture rate (of `storage_dtype`, else bfloat16) and the FLOP rate it
    implies."""
    cap = read_json(cap_p)
    per = (
        (cap.get("per_storage_dtype") or {}).get(storage_dtype)
        or (cap.get("per_storage_dtype") or {}).get("bfloat16")
        or cap
    )
    cap_tps = float(per["capture_tokens_per_s"])
    mean_len = cap["num_tokens"] / cap["num_prompts"]
    overhead = float(per.get("ratio_of_means") or cap.get("ratio_of_means") or 1.0)
    ref_flops = count_target_forward_flops(REFBENCH_TARGET, mean_len)["total"]
    return {
        "file": str(cap_p.name),
        "key": f"per_storage_dtype.{storage_dtype}.capture_tokens_per_s",
        "tokens_per_s": cap_tps,
        "target": "refbench target-a-llama (8 layers, H=384)",
        "mean_prompt_tokens": round(mean_len, 1),
        "flops_per_token": ref_flops,
        "achieved_flops": cap_tps * ref_flops,
        "capture_over_prefill": overhead,
        "machine": f"{cap['machine'].get('cpu_count')}-core CPU, {cap.get('dtype', '?')} compute",
        "date": cap.get("date"),
    }


def _train_anchor(train_p: Path) -> dict[str, Any]:
    """The fastest measured GPU training configuration and the FLOP rate it achieved."""
    tr = read_json(train_p)
    ok = [
        c
        for c in tr.get("configs", [])
        if c.get("status") == "ok" and c.get("kind") != "naive" and c.get("tokens_per_s")
    ]
    if not ok or tr.get("smoke"):
        raise ConfigError(
            f"{train_p} has no measured GPU configuration (status ok); rerun "
            "benchmarks/train_step.py on a GPU"
        )
    best = max(ok, key=lambda c: c["tokens_per_s"])
    dims = tr["dims"]
    f_tok = count_train_flops(dims, best["seq"], best["K"])["model_flops_per_token"]
    spec = float((tr.get("rates") or {}).get("spec_bf16_flops") or H200_BF16_TFLOPS * 1e12)
    achieved = best["tokens_per_s"] * f_tok
    return {
        "file": str(train_p.name),
        "config": best["name"],
        "tokens_per_s": best["tokens_per_s"],
        "seq": best["seq"],
        "K": best["K"],
        "dims": dims,
        "flops_per_token": f_tok,
        "achieved_flops": achieved,
        "gpu": (tr.get("machine") or {}).get("gpu"),
        "mfu_vs_datasheet": achieved / spec,
        "date": tr.get("date"),
    }


# ----------------------------------------------------------------------------------------- the plan


def run_plan(cfg: PlanConfig) -> PlanResult:
    """Estimate storage, capture and training time for `cfg.config` on `cfg.hardware`; nothing is
    run."""
    from eagle3.model.draft import text_config  # torch: not on the CLI's import of PlanConfig

    cfg.require("config")
    pipe = load_pipeline_config(cfg.config).resolved()
    set_by_caller = set(cfg.model_fields_set)
    cfg = with_config_defaults(cfg, pipe.plan)
    tpath, target_cfg = _read_target_config(cfg, pipe)
    tc = text_config(target_cfg)
    hw = HARDWARE[cfg.hardware]
    num_gpus = cfg.num_gpus or hw.num_gpus
    notes: list[str] = []

    n, mean, source = _dataset_size(cfg, pipe, set_by_caller)
    num_tokens = int(round(n * mean))
    storage = _storage_fields(cfg, pipe, tc, num_tokens)
    st = storage["storage"]
    disk, disk_src = _disk_bytes(cfg, hw, pipe)
    reserve = int(pipe.capture.min_free_disk_gb * 1024**3)
    anchors = load_anchors(cfg.results_dir or RESULTS_DIR, st.storage_dtype)
    target = _target_fields(cfg, pipe, hw, num_gpus, tc, target_cfg, mean, notes)
    tp, bits = target["capture_tensor_parallel_size"], target["target_weight_bits"]
    t_flops = target["target_flops_per_token"]
    capture = _capture_rate(
        hw, num_gpus, tp, tc, t_flops, anchors["capture"], anchors["train"], num_tokens
    )
    draft = _draft_fields(cfg, pipe, target_cfg, len(storage["aux_layer_ids"]), num_tokens)
    train = _train_rate(
        hw, num_gpus, draft["draft_flops_per_token"], anchors, draft["train_tokens"]
    )
    _note_draft_memory(pipe, hw, draft["draft_params"], notes)
    regen = (
        _regenerate_rate(hw, num_gpus, pipe.regenerate, target_cfg, bits, mean, num_tokens)
        if pipe.regenerate.enabled
        else None
    )
    mode = _mode_fields(pipe, storage, disk, reserve, capture, draft["epochs"], notes)
    predicted = _predicted_speedups(pipe, hw, num_gpus, target_cfg, bits, notes)
    return PlanResult(
        config=str(cfg.config),
        target_config=str(tpath),
        hardware=_hardware_record(hw, num_gpus, disk_src),
        num_samples=n,
        mean_tokens=mean,
        sample_source=source,
        **storage,
        disk_bytes=disk,
        disk_reserve_bytes=reserve,
        **mode,
        **target,
        capture=capture,
        **draft,
        train=train,
        regenerate=regen,
        regenerate_tokens=num_tokens if regen else None,
        predicted_speedup=predicted,
        train_read_bytes_per_s=train.tokens_per_s * st.bytes_per_token,
        anchors=anchors,
        notes=notes,
    )


def _hardware_record(hw: Any, num_gpus: int, disk_source: str) -> dict[str, Any]:
    """The hardware profile as the plan records it."""
    return {
        **asdict(hw),
        "num_gpus": num_gpus,
        "disk_source": disk_source,
        "ratio_vs_h200": None
        if hw.bf16_tflops is None
        else round(hw.bf16_tflops / H200_BF16_TFLOPS, 3),
    }


def _read_target_config(cfg: PlanConfig, pipe: Any) -> tuple[Path, dict[str, Any]]:
    """The target's config.json (--target-config, else the pipeline's target): its path, its
    contents."""
    tpath = Path(cfg.target_config or pipe.target)
    if tpath.is_dir():
        tpath = tpath / "config.json"
    if not tpath.is_file():
        raise ConfigError(
            f"PlanConfig.target_config: {tpath} does not exist; pass --target-config with the "
            "target's config.json or model dir (config-only shapes of the preset targets are in "
            "configs/targets/)"
        )
    return tpath, read_json(tpath)


def _storage_fields(cfg: PlanConfig, pipe: Any, tc: dict, num_tokens: int) -> dict[str, Any]:
    """The capture's aux layers and its size on disk, in the storage dtype, fp8 and bfloat16."""
    from eagle3.shards import estimate_storage

    aux_layer_ids = AuxLayerIds.resolve(
        pipe.capture.aux_layer_ids, int(tc["num_hidden_layers"])
    ).as_list()
    dtype = cfg.storage_dtype or pipe.capture.storage_dtype
    hidden_size = int(tc["hidden_size"])
    return {
        "aux_layer_ids": aux_layer_ids,
        "storage": estimate_storage(len(aux_layer_ids), hidden_size, dtype, num_tokens),
        "storage_fp8_bytes": estimate_storage(
            len(aux_layer_ids), hidden_size, "fp8", num_tokens
        ).total_bytes,
        "storage_bf16_bytes": estimate_storage(
            len(aux_layer_ids), hidden_size, "bfloat16", num_tokens
        ).total_bytes,
    }


def _disk_bytes(cfg: PlanConfig, hw: Any, pipe: Any) -> tuple[int, str]:
    """The disk the capture may fill, and where that figure comes from."""
    from eagle3.shards import free_disk_bytes

    if cfg.disk_tb is not None:
        return int(cfg.disk_tb * 1e12), "--disk-tb"
    if hw.disk_tb is not None:
        return int(hw.disk_tb * 1e12), hw.sources.get("disk_tb", "profile")
    return free_disk_bytes(pipe.work_dir), f"free space at {pipe.work_dir}, measured now"


def _target_fields(
    cfg: PlanConfig,
    pipe: Any,
    hw: Any,
    num_gpus: int,
    tc: dict,
    target_cfg: dict,
    mean_tokens: float,
    notes: list[str],
) -> dict[str, Any]:
    """The target's parameters, FLOPs per token and weights per GPU (a note when they do not fit
    the GPU's memory)."""
    tparams = count_target_params(tc)
    bits = cfg.target_weight_bits or _weight_bits(target_cfg)
    tp = min(pipe.capture.tensor_parallel_size, num_gpus)
    weights_per_gpu = tparams["total"] * bits / 8 / tp
    weights_fit = hw.bf16_tflops is None or weights_per_gpu <= 0.9 * hw.memory_gb * 1e9
    if not weights_fit:
        notes.append(
            f"target weights at {bits} bits are {weights_per_gpu / 1e9:.0f} GB per GPU at "
            f"tensor_parallel_size {tp}, over 90% of {hw.memory_gb:.0f} GB: use a quantized "
            "checkpoint (--target-weight-bits), more GPUs (pipeline/expert parallel across nodes), "
            "or a larger-memory profile"
        )
    return {
        "target_params": tparams["total"],
        "target_active_params": tparams["active_per_token"],
        "target_flops_per_token": count_target_forward_flops(tc, mean_tokens)["total"],
        "target_weight_bits": bits,
        "weights_per_gpu_bytes": weights_per_gpu,
        "weights_fit": weights_fit,
        "capture_tensor_parallel_size": tp,
    }


def _draft_fields(
    cfg: PlanConfig, pipe: Any, target_cfg: dict, num_aux: int, num_tokens: int
) -> dict[str, Any]:
    """The draft's trainable parameters, its training FLOPs per token and the tokens it trains
    on."""
    from eagle3.model.family import get_family

    draft = get_family(pipe.train.draft.family).draft_config(
        target_cfg,
        num_aux=num_aux,
        draft_vocab_size=pipe.vocab.draft_vocab_size,
        options=pipe.train.draft,
    )
    m = draft_dims(draft)
    d_flops = count_train_flops(m, pipe.train.loader.max_seq_len, pipe.train.loss.ttt_steps)[
        "model_flops_per_token"
    ]
    epochs = cfg.epochs or pipe.train.epochs
    return {
        "draft_params": sum(p for p, _ in count_draft_params(m).values()),
        "draft_flops_per_token": d_flops,
        "epochs": epochs,
        "train_tokens": num_tokens * (1 - pipe.train.loader.val_fraction) * epochs,
    }


def _note_draft_memory(pipe: Any, hw: Any, draft_params: int, notes: list[str]) -> None:
    """A note when the draft's training state does not fit half a GPU under ddp."""
    if pipe.train.runtime.parallel == "ddp" and draft_params * 16 > 0.5 * hw.memory_gb * 1e9:
        notes.append(
            f"draft has {draft_params / 1e9:.2f} B trainable parameters = "
            f"{draft_params * 16 / 1e9:.0f} GB of fp32 weights + grads + AdamW state per GPU under "
            "ddp: use train.runtime.parallel fsdp2 (or auto)"
        )


def _mode_fields(
    pipe: Any,
    storage: dict[str, Any],
    disk: int,
    reserve: int,
    capture: RateEstimate,
    epochs: float,
    notes: list[str],
) -> dict[str, Any]:
    """Offline when the whole capture fits the disk, else streaming into a bounded spool (a note
    when streaming captures every epoch again)."""
    st, fp8_bytes = storage["storage"], storage["storage_fp8_bytes"]
    if st.total_bytes + reserve <= disk:
        reason = (
            f"the whole capture ({format_bytes(st.total_bytes)}) fits the disk "
            f"({format_bytes(disk)})"
        )
        return {"mode": "offline", "mode_reason": reason, "spool_cap_bytes": None}
    spool = _spool_cap(
        disk - reserve, st.bytes_per_token, capture.tokens_per_s, pipe.capture.shard_tokens
    )
    alt = (
        " (fp8 would not fit either)"
        if fp8_bytes + reserve > disk
        else (
            f" (fp8, {format_bytes(fp8_bytes)}, would fit offline)"
            if st.storage_dtype != "fp8"
            else ""
        )
    )
    reason = (
        f"the capture ({format_bytes(st.total_bytes)}) does not fit the disk "
        f"({format_bytes(disk)}){alt}: "
        "capture into a bounded spool that training drains (stream.enabled: true, "
        f"stream.spool_cap_gb: {spool / 1e9:.0f})"
    )
    if epochs > 1:
        notes.append(
            f"streaming with {epochs:g} epochs: every epoch is captured again (capture time x "
            f"{epochs:g})"
        )
    return {"mode": "streaming", "mode_reason": reason, "spool_cap_bytes": spool}


def with_config_defaults(cfg: PlanConfig, defaults: dict[str, Any]) -> PlanConfig:
    """`cfg` with the fields its caller did not set taken from the pipeline config's `plan:` section
    (a preset carries the target shape and dataset size a plan needs; flags override)."""
    if not defaults:
        return cfg
    if "config" in defaults:
        raise ConfigError(
            f"{cfg.config}: plan.config: not allowed inside a config (it is the config itself)"
        )
    try:
        preset = PlanConfig.model_validate({**defaults, "config": cfg.config})
    except ValidationError as e:
        raise ConfigError(
            format_validation_error(e, f"{cfg.config} (its plan: section)").replace(
                "\n  ", "\n  plan."
            )
        ) from None
    return preset.model_copy(update={k: getattr(cfg, k) for k in cfg.model_fields_set})


def _dataset_size(cfg: PlanConfig, pipe: Any, set_by_caller: set[str]) -> tuple[int, float, str]:
    """(samples, mean tokens/sample, where they came from): flags, else the prepared manifest, else
    the config's plan: section, else the config's limit."""
    manifest = Path(pipe.capture.data or "") / PreparedMeta.FILE
    m = PreparedMeta.read(manifest) if manifest.is_file() else PreparedMeta()
    preset = pipe.plan or {}
    n = cfg.num_samples if "num_samples" in set_by_caller else None
    mean = cfg.mean_tokens if "mean_tokens" in set_by_caller else None
    src = ["samples from --num-samples"] if n is not None else []
    if n is None and m.num_samples:
        n, src = int(m.num_samples), [f"samples from {manifest}"]
    elif n is None and preset.get("num_samples"):
        n, src = int(preset["num_samples"]), [f"samples from {cfg.config}'s plan.num_samples"]
    elif n is None and (pipe.capture.limit or pipe.prepare.limit):
        n, src = int(pipe.capture.limit or pipe.prepare.limit), ["samples from the config's limit"]
    if mean is not None:
        src.append("mean tokens from --mean-tokens")
    elif m.num_samples:
        m.require("num_tokens")
        mean = m.num_tokens / m.num_samples
        src.append(f"mean tokens from {manifest}")
    elif preset.get("mean_tokens"):
        mean = float(preset["mean_tokens"])
        src.append(f"mean tokens from {cfg.config}'s plan.mean_tokens")
    if n is None or mean is None:
        missing = "--num-samples" if n is None else "--mean-tokens"
        raise ConfigError(
            f"PlanConfig: the dataset size is unknown ({manifest} does not exist yet): pass "
            f"{missing}, set plan.{missing[2:].replace('-', '_')} in {cfg.config}, or run `eagle3 "
            "prepare` first (its manifest has both)"
        )
    if pipe.capture.limit:
        n = min(n, int(pipe.capture.limit))
    return int(n), float(mean), "; ".join(src)


def _weight_bits(target_cfg: dict) -> int:
    """Bits per weight of the checkpoint: compressed-tensors' num_bits when quantized, else 16."""
    q = (
        (target_cfg.get("text_config") or {}).get("quantization_config")
        or target_cfg.get("quantization_config")
        or {}
    )
    bits = [g.get("weights", {}).get("num_bits") for g in (q.get("config_groups") or {}).values()]
    bits = [b for b in bits if b]
    return int(min(bits)) if bits else 16


def _capture_rate(
    hw: HardwareProfile,
    num_gpus: int,
    tp: int,
    tc: dict,
    t_flops: float,
    cap: dict,
    train: dict,
    num_tokens: int,
) -> RateEstimate:
    if hw.bf16_tflops is None:
        rate = cap["achieved_flops"] / t_flops
        basis = (
            f"measured {cap['tokens_per_s']:.0f} tok/s capture of the refbench target on this CPU "
            f"({cap['flops_per_token'] / 1e9:.3f} GFLOP/token) x FLOP ratio "
            f"{cap['flops_per_token'] / t_flops:.3g}"
        )
        return RateEstimate(
            rate,
            num_tokens / rate / 3600,
            num_tokens / rate / 3600,
            "compute (measured CPU rate)",
            basis,
        )
    eff = train["mfu_vs_datasheet"]
    compute = num_gpus * hw.bf16_tflops * 1e12 * eff / t_flops / cap["capture_over_prefill"]
    bound, rate = "compute", compute
    basis = (
        f"{num_gpus} x {hw.bf16_tflops:g} TFLOP/s (x{hw.bf16_tflops / H200_BF16_TFLOPS:.2f} of the "
        f"H200) at {eff:.1%} of datasheet (measured H200 train step) / {t_flops / 1e9:.1f} "
        f"GFLOP/token / capture overhead x{cap['capture_over_prefill']:.2f} (measured on the CPU)"
    )
    if tp > 1 and hw.interconnect_gb_s:
        # two all-reduces of H bf16 values per layer per token; a ring all-reduce moves 2 (tp-1)/tp
        # of it per GPU
        per_token = (
            2 * int(tc["num_hidden_layers"]) * int(tc["hidden_size"]) * 2 * 2 * (tp - 1) / tp
        )
        comm = (num_gpus // tp) * hw.interconnect_gb_s * 1e9 / per_token
        basis += (
            f"; TP={tp} all-reduce {per_token / 1e6:.2f} MB/token over {hw.interconnect} "
            f"{hw.interconnect_gb_s:g} GB/s -> {comm:,.0f} tok/s"
        )
        if comm < compute:
            bound, rate = f"interconnect ({hw.interconnect})", comm
    hours = num_tokens / rate / 3600
    return RateEstimate(rate, hours, hours * num_gpus, bound, basis)


def _train_rate(
    hw: HardwareProfile, num_gpus: int, d_flops: float, anchors: dict, tokens: float
) -> RateEstimate:
    tr = anchors["train"]
    if hw.bf16_tflops is None:
        rate = anchors["capture"]["achieved_flops"] / d_flops
        basis = (
            "the CPU's measured capture FLOP rate "
            f"({anchors['capture']['achieved_flops'] / 1e9:.1f} GFLOP/s) / {d_flops / 1e9:.1f} "
            "GFLOP/token (training not measured on this CPU)"
        )
        return RateEstimate(
            rate, tokens / rate / 3600, tokens / rate / 3600, "compute (measured CPU rate)", basis
        )
    ratio = hw.bf16_tflops / H200_BF16_TFLOPS
    rate = num_gpus * tr["tokens_per_s"] * tr["flops_per_token"] / d_flops * ratio
    basis = (
        f"measured {tr['tokens_per_s']:,.0f} tok/s on one H200 ({tr['config']}, "
        f"{tr['flops_per_token'] / 1e9:.2f} GFLOP/token) x FLOP ratio "
        f"{tr['flops_per_token'] / d_flops:.3g} x {ratio:.2f} (TFLOP/s vs H200) x {num_gpus} GPUs "
        "(linear data-parallel scaling assumed)"
    )
    hours = tokens / rate / 3600
    return RateEstimate(rate, hours, hours * num_gpus, "compute", basis)


def _regenerate_rate(
    hw: HardwareProfile,
    num_gpus: int,
    regen: Any,
    target_cfg: dict,
    bits: int,
    mean_tokens: float,
    num_tokens: float,
) -> RateEstimate | None:
    """The target decoding the training answers (every token of the dataset, an upper bound: the
    prompts are not generated), per tensor-parallel replica: one decode step of `batch` sequences
    at the mean context (half a sample) priced by the step-time model (eagle3.step_time: the
    weights it reads, an MoE layer's routed experts by the batch's routing, the KV cache, the
    all-reduces, the fixed time per pass), the batch as large as regenerate.batch_size and the KV
    room allow."""
    if hw.bf16_tflops is None or not hw.memory_tb_s:
        return None
    tc = target_cfg.get("text_config") or target_cfg
    tp = min(regen.tensor_parallel_size, num_gpus)
    replicas = max(num_gpus // tp, 1)
    p = count_target_params(tc)
    kv_token = kv_cache_bytes_per_token(tc)
    # per GPU: its memory less its share of the weights, over a sample's KV on that GPU (MLA's
    # latent cache is whole on every rank)
    room = 0.9 * hw.memory_gb * 1e9 - p["total"] * bits / 8 / tp
    per_sample = kv_bytes_per_token_per_gpu(tc, tp) * mean_tokens
    batch = int(max(1, min(regen.batch_size, room // max(per_sample, 1))))
    step = predict_pass_time_s(target_cfg, hw, tp, 1, batch, mean_tokens / 2, weight_bits=bits)
    rate = replicas * batch / step.total_s
    weights = sum(step.weight_bytes.values()) * tp
    bound = (
        f"{step.bound}: {format_bytes(weights)} weights + {format_bytes(step.kv_bytes)} KV per "
        "step"
        + (f"; all-reduce {step.comm_s * 1e3:.1f} ms of {step.total_s * 1e3:.1f} ms" * (tp > 1))
    )
    basis = (
        f"modelled, not measured (eagle3.step_time, {step.routing_source}): {replicas} "
        f"replica(s) of TP={tp}, batch {batch} (regenerate.batch_size {regen.batch_size}, KV room "
        f"for {mean_tokens:,.0f}-token samples at {kv_token:,} B/token), step "
        f"{step.total_s * 1e3:.1f} ms"
    )
    hours = num_tokens / rate / 3600
    return RateEstimate(rate, hours, hours * replicas * tp, bound, basis)


def _predicted_speedups(
    pipe: Any, hw: HardwareProfile, num_gpus: int, target_cfg: dict, bits: int, notes: list[str]
) -> dict[str, Any] | None:
    """The speed-up per k and concurrency of every method evaluate measured (its results.json
    under evaluate.out: acceptance per position, drafted fraction, mean context, the draft's dir)
    on this hardware, at the smallest tensor parallel size the weights fit; routing from
    capture's routing.json when it exists. None before an evaluation or on the CPU profile."""
    out = Path(pipe.evaluate.out or "")
    if hw.bf16_tflops is None or not (out / EvalResults.FILE).is_file():
        return None
    res = EvalResults.load(out)
    captured = Path(pipe.capture.out or "")
    routing = MeasuredRouting.read(captured) if (captured / RoutingStats.FILE).is_file() else None
    metrics = (getattr(res, "speculative_run", None) or {}).get("metrics") or {}
    head = res.all_row()
    if head is None or not head.num_prompts:
        return None
    context = (metrics.get("vllm:prompt_tokens", 0) + head.generated_tokens / 2) / head.num_prompts
    tp = min(serving_tensor_parallel_size(target_cfg, hw, bits), num_gpus)
    first = head.temperature
    draft_dir = Path(str((getattr(res, "config", None) or {}).get("draft") or ""))
    out_preds = {}
    for row in [head, *res.comparisons]:
        if row.category != "all" or row.temperature != first or row.method in out_preds:
            continue
        draft = None
        if row.method != "ngram":
            if not any(draft_dir.glob("*.safetensors")):
                notes.append(
                    f"{out / EvalResults.FILE}: its draft {draft_dir} is gone; no predicted "
                    f"speed-up for {row.method} (evaluate again, or restore the draft)"
                )
                continue
            draft = draft_weights(draft_dir)
        pred = predict_from_row(target_cfg, hw, row, draft, context, routing, tp, bits)
        out_preds[row.method] = pred.as_dict()
    return out_preds or None


def _spool_cap(room: int, bpt: int, capture_tps: float, shard_tokens: int) -> int:
    """Recommended spool bound: one hour of capture output (lets training stall or restart without
    stopping capture), at least 4 shards, at most half of the usable disk."""
    hour = int(capture_tps * 3600 * bpt)
    return int(max(min(hour, room // 2), min(4 * shard_tokens * bpt, room)))


# ----------------------------------------------------------------------------------------- printing


def _fmt_hours(h: float) -> str:
    return f"{h * 60:.1f} min" if h < 1 else (f"{h:.1f} h" if h < 48 else f"{h / 24:.1f} days")


def format_plan(r: PlanResult) -> str:
    """The human-readable table `eagle3 plan` prints."""
    rows = _input_rows(r) + _estimate_rows(r)
    width = max(len(k) for k, _ in rows)
    lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
    lines.append("basis:")
    if r.regenerate is not None:
        lines.append(f"  regenerate: {r.regenerate.basis}")
    lines.append(f"  capture: {r.capture.basis}")
    lines.append(f"  train: {r.train.basis}")
    for p in (r.predicted_speedup or {}).values():
        lines += ["", p["table_markdown"].rstrip()]
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def _input_rows(r: PlanResult) -> list[tuple[str, str]]:
    """The plan's inputs (config, target, hardware, dataset, storage, disk) and its mode."""
    hw, st = r.hardware, r.storage
    return [
        ("config", r.config),
        (
            "target",
            f"{r.target_config}: {r.target_params / 1e9:,.1f} B params, "
            f"{r.target_active_params / 1e9:.1f} B active/token, "
            f"{r.target_flops_per_token / 1e9:.1f} GFLOP/token prefill",
        ),
        (
            "hardware",
            f"{hw['name']}: {hw['description']}"
            + (
                f", {hw['num_gpus']} GPUs x {hw['bf16_tflops']:g} TFLOP/s bf16 "
                f"(x{hw['ratio_vs_h200']:.2f} H200)"
                if hw["bf16_tflops"]
                else ""
            ),
        ),
        (
            "dataset",
            f"{r.num_samples:,} samples x {r.mean_tokens:,.0f} tokens = {st.num_tokens:,} tokens "
            f"({r.sample_source})",
        ),
        (
            "captured layers",
            f"aux {r.aux_layer_ids} + last, H = {st.hidden_size}, {st.storage_dtype}",
        ),
        (
            "bytes/token",
            f"{st.bytes_per_token:,} B ({st.state_bytes_per_token:,} B states = "
            f"{st.state_bytes_per_token / 1024:.1f} KiB + ids/mask/scales)",
        ),
        (
            "storage",
            f"{format_bytes(st.total_bytes)} ({st.storage_dtype}); "
            f"bf16 {format_bytes(r.storage_bf16_bytes)}, "
            f"fp8 {format_bytes(r.storage_fp8_bytes)}",
        ),
        ("disk", f"{format_bytes(r.disk_bytes)} ({hw['disk_source']})"),
        ("mode", f"{r.mode.upper()}: {r.mode_reason}"),
    ]


def _estimate_rows(r: PlanResult) -> list[tuple[str, str]]:
    """The plan's estimates: the target's weights per GPU, then each stage's time."""
    hw = r.hardware
    rows = [
        (
            "target weights",
            f"{r.weights_per_gpu_bytes / 1e9:,.0f} GB/GPU at {r.target_weight_bits} bits, "
            f"TP={r.capture_tensor_parallel_size} -> {'fits' if r.weights_fit else 'DOES NOT FIT'} "
            f"{hw['memory_gb']:g} GB",
        ),
    ]
    for method, p in (r.predicted_speedup or {}).items():
        rows.append((f"speculation ({method})", p["summary"]))
    if r.regenerate is not None:
        rows.append(
            (
                "regenerate",
                f"<= {r.regenerate_tokens:,.0f} tokens generated; "
                f"{r.regenerate.tokens_per_s:,.0f} tok/s -> {_fmt_hours(r.regenerate.hours)} "
                f"wall, {r.regenerate.gpu_hours:,.0f} GPU-h (bound: {r.regenerate.bound})",
            ),
        )
    return rows + [
        (
            "capture",
            f"{r.capture.tokens_per_s:,.0f} tok/s -> {_fmt_hours(r.capture.hours)} wall, "
            f"{r.capture.gpu_hours:,.0f} GPU-h (bound: {r.capture.bound})",
        ),
        (
            "train",
            f"{r.draft_params / 1e9:.2f} B-param draft, {r.draft_flops_per_token / 1e9:.1f} "
            f"GFLOP/token, {r.epochs:g} epochs = {r.train_tokens:,.0f} tokens; "
            f"{r.train.tokens_per_s:,.0f} tok/s -> {_fmt_hours(r.train.hours)} wall, "
            f"{r.train.gpu_hours:,.0f} GPU-h; reads {format_bytes(r.train_read_bytes_per_s)}/s of "
            "states",
        ),
    ]
