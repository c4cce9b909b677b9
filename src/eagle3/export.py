"""`run_export(cfg)`: a trained draft -> a directory vLLM loads as its speculative draft.

The draft's family (eagle3.model.family; eagle3_draft.json's draft_config.family) writes the
config.json of each format it offers (the EAGLE-3 families' formats: eagle3.model.eagle):
    format=vllm         config.json of the family's vLLM architecture; model.safetensors holds the
                        draft's export_state_dict (bf16; d2t int64, t2d bool), no embed_tokens: vLLM
                        shares the target's embedding. When draft vocab == target vocab vLLM has no
                        d2t buffer (an unexpected d2t key fails its loader): lm_head rows are put in
                        target order and d2t/t2d are left out
    format=speculators  the speculators library's layout: weights named layers.0.* (not midlayer.*)
                        plus embed_tokens.weight (speculators checkpoints carry the embedding)
Tokenizer files of the target are copied (vLLM uses the target's tokenizer anyway).

Every key and shape is checked against the draft config before anything is written (the family
builds the draft on the meta device: the tensors a checkpoint of that shape holds), and the layer
ids, hidden sizes and vocab sizes are checked against the capture manifest and the target config;
the directory is built under a temp name and renamed.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from eagle3.artifacts import (
    CaptureManifest,
    DraftMetadata,
    DraftVocab,
    SpoolHeader,
    capture_dirs,
    latest_checkpoint,
)
from eagle3.config import AuxLayerIds, ConfigError, ExportConfig
from eagle3.integrity import (
    check_target_identity,
    identity_record,
    nonfinite_tensors,
    target_identity,
)
from eagle3.io import atomic_dir, read_safetensors, write_json
from eagle3.model.draft import DraftConfig, text_config
from eagle3.model.family import DraftFamily, get_family
from eagle3.weights import load_target_tensors

METADATA = DraftMetadata.FILE
WEIGHTS = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)


class ExportError(ValueError):
    """The checkpoint disagrees with the capture / target / vLLM's expectations; nothing was
    written."""


@dataclass
class ExportResult:
    out: Path
    format: str
    checkpoint: Path
    config: dict[str, Any]
    tensors: dict[str, list[int]] = field(default_factory=dict)
    aux_layer_ids: list[int] = field(default_factory=list)


def resolve_checkpoint(path: str | Path) -> Path:
    """A dir holding model.safetensors + eagle3_draft.json, or a training out dir (best > final >
    latest step)."""
    p = Path(path)
    if (p / WEIGHTS).is_file() and (p / METADATA).is_file():
        return p
    for sub in ("best", "final"):
        if (p / sub / WEIGHTS).is_file() and (p / sub / METADATA).is_file():
            return p / sub
    ck = latest_checkpoint(p)
    if ck is None:
        raise ExportError(
            f"checkpoint={path}: no {WEIGHTS} + {METADATA} there, nor best/, final/ or "
            "checkpoints/step-N/; pass the `out` dir of `eagle3 train` or one checkpoint dir in it"
        )
    return ck


def _manifest(captured: str | None) -> CaptureManifest | SpoolHeader | None:
    """The capture the checkpoint was trained on (one dir, several comma-separated, or a streaming
    spool), or None when it is gone (checked against it when it is still there)."""
    if not captured or not all(d.is_dir() for d in capture_dirs(captured)):
        return None
    header = Path(captured) / SpoolHeader.FILE
    if header.is_file() and not (Path(captured) / CaptureManifest.FILE).is_file():
        # trained from a streaming spool: its header carries the capture's aux ids and hidden size
        return SpoolHeader.read(header)
    return CaptureManifest.load_combined(captured)


def export_shapes(family: DraftFamily, dcfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor (and its shape) an export of a `dcfg`-shaped draft of `family` holds: the
    family's draft built on the meta device (no memory, no weights)."""
    with torch.device("meta"):
        model = family.build(dcfg)
    return {k: tuple(v.shape) for k, v in model.export_state_dict().items()}


def validate(
    meta: DraftMetadata,
    dcfg: DraftConfig,
    tensors: dict[str, torch.Tensor],
    target_cfg: dict,
    manifest: CaptureManifest | SpoolHeader | None,
) -> None:
    """Raise ExportError naming the field, the bad value and the fix; never returns partially."""
    tc = text_config(target_cfg)
    _check_layers(meta, dcfg, tc, manifest)
    _check_shapes(dcfg, tc, manifest)
    _check_tensors(dcfg, tensors)


def _check_layers(
    meta: DraftMetadata,
    dcfg: DraftConfig,
    tc: dict,
    manifest: CaptureManifest | SpoolHeader | None,
) -> None:
    """The checkpoint's aux layer ids: the capture's (or a subset chosen from them), as many as
    the draft reads, distinct, within the target's layers."""
    ids = list(meta.aux_layer_ids)
    L = tc.get("num_hidden_layers")
    captured = list(manifest.aux_layer_ids) if manifest is not None else None
    if captured is not None and captured != ids:
        # a layer subset (TrainConfig.aux_layer_ids) is fine when the checkpoint says it was chosen
        # from this capture
        if meta.captured_aux_layer_ids != captured or not set(ids) <= set(captured) | {L}:
            raise ExportError(
                f"aux_layer_ids={ids} in the checkpoint metadata differ from the capture "
                f"manifest's aux_layer_ids={manifest.aux_layer_ids}; the draft was trained on the "
                "manifest's aux_layer_ids, re-train or fix the metadata"
            )
    if len(ids) != dcfg.num_aux or len(set(ids)) != len(ids):
        raise ExportError(
            f"aux_layer_ids={ids}: expected {dcfg.num_aux} distinct ids (the fc reads "
            f"{dcfg.num_aux} states)"
        )
    if L is not None:  # a draft may read the last layer (id L) when trained so (TrainConfig)
        AuxLayerIds(tuple(ids)).check(
            L, "checkpoint aux_layer_ids", last_ok=True, error=ExportError
        )


def _check_shapes(
    dcfg: DraftConfig, tc: dict, manifest: CaptureManifest | SpoolHeader | None
) -> None:
    """The draft's and the capture's hidden size, vocab size and positions: the target's."""
    if manifest is not None and manifest.hidden_size != tc["hidden_size"]:
        raise ExportError(
            f"capture hidden_size={manifest.hidden_size} but target "
            f"hidden_size={tc['hidden_size']}: export "
            "against the target the data was captured from"
        )
    for name, want in (("target_hidden_size", tc["hidden_size"]), ("vocab_size", tc["vocab_size"])):
        if getattr(dcfg, name) != want:
            raise ExportError(
                f"draft {name}={getattr(dcfg, name)} but the target config says {want}; pass "
                "--target the model the draft was trained for"
            )
    if dcfg.max_position_embeddings < tc.get("max_position_embeddings", 0):
        raise ExportError(
            f"draft max_position_embeddings={dcfg.max_position_embeddings} < target's "
            f"{tc['max_position_embeddings']}; re-train with draft.max_position_embeddings unset"
        )


def _check_tensors(dcfg: DraftConfig, tensors: dict[str, torch.Tensor]) -> None:
    """The checkpoint's tensors: the draft family's names and shapes, and a d2t/t2d pair that
    maps the draft vocabulary one-to-one into the target's."""
    want = export_shapes(get_family(dcfg.family), dcfg)
    missing = sorted(set(want) - set(tensors))
    extra = sorted(set(tensors) - set(want))
    if missing or extra:
        raise ExportError(
            f"checkpoint tensors: missing {missing}, unexpected {extra}; the checkpoint is "
            "incomplete or foreign"
        )
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise ExportError(
                f"tensor {k} has shape {tuple(tensors[k].shape)}, expected {shape} from the draft "
                "config"
            )
    d2t = tensors["d2t"]
    tgt = torch.arange(d2t.numel()) + d2t
    if (
        int(tgt.min()) < 0
        or int(tgt.max()) >= dcfg.vocab_size
        or tgt.unique().numel() != tgt.numel()
    ):
        raise ExportError(
            "d2t maps draft ids outside [0, target vocab) or twice to one target id; rebuild the "
            "vocab"
        )
    if not bool(tensors["t2d"][tgt].all()) or int(tensors["t2d"].sum()) != d2t.numel():
        raise ExportError(
            "t2d disagrees with d2t (t2d must be True exactly at the draft's target ids); rebuild "
            "the vocab"
        )


def family_exporting(dcfg: DraftConfig, fmt: str) -> DraftFamily:
    """The draft's family (eagle3.model.family), when it writes format `fmt`."""
    family = get_family(dcfg.family)
    if fmt not in family.export_formats:
        raise ExportError(
            f"format={fmt}: the draft family {family.name} exports "
            f"{', '.join(family.export_formats)}; pass --format {family.export_formats[0]}"
        )
    return family


def run_export(cfg: ExportConfig) -> ExportResult:
    cfg.require("checkpoint", "out")
    ck = resolve_checkpoint(cfg.checkpoint)
    meta = DraftMetadata.load(ck)
    dcfg = DraftConfig.from_dict(meta.draft_config)
    family = family_exporting(dcfg, cfg.format)
    if not cfg.target:
        meta.require("target")
    target = cfg.target or meta.target
    tpath = Path(target) / "config.json"
    if not tpath.is_file():
        raise ConfigError(
            f"ExportConfig.target={target!r} has no config.json; pass --target with the target "
            "model dir"
        )
    target_cfg = json.loads(tpath.read_text())
    tensors = _read_finite_weights(ck)
    manifest = _manifest(meta.captured)
    validate(meta, dcfg, tensors, target_cfg, manifest)
    serves = _check_target(cfg, meta, ck, target, manifest)
    _check_vocab(meta, tensors)
    ids = list(meta.aux_layer_ids)
    out_t = _served_tensors(tensors, dcfg)
    verifier = {"name_or_path": meta.target, "architectures": target_cfg.get("architectures", [])}
    config = family.export_config(dcfg, ids, cfg.format, verifier)
    if cfg.format == "speculators":
        out_t = {k.replace("midlayer.", "layers.0."): v for k, v in out_t.items()}

        out_t["embed_tokens.weight"] = (
            load_target_tensors(target)["embed"].to(torch.bfloat16).contiguous()
        )
    with atomic_dir(cfg.out) as tmp:
        save_file(out_t, str(tmp / WEIGHTS), metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        meta.model_copy(update={**serves, "export_format": cfg.format}).save(tmp)
        for name in TOKENIZER_FILES:
            if (Path(target) / name).is_file():
                shutil.copy2(Path(target) / name, tmp / name)
    return ExportResult(
        Path(cfg.out), cfg.format, ck, config, {k: list(v.shape) for k, v in out_t.items()}, ids
    )


def _read_finite_weights(ck: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's weights; ExportError when any holds NaN/inf."""
    tensors = read_safetensors(
        ck / WEIGHTS,
        "draft checkpoint weights",
        "export another checkpoint (e.g. checkpoints/step-N)",
    )
    bad = nonfinite_tensors(tensors)
    if bad:
        raise ExportError(
            f"{ck / WEIGHTS} holds NaN/inf in "
            f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}: a draft that cannot propose "
            "anything; nothing was written. Export an earlier checkpoint or train again (check "
            "the capture)"
        )
    return tensors


def _check_target(
    cfg: ExportConfig, meta: DraftMetadata, ck: Path, target: str, manifest: Any
) -> dict[str, Any]:
    """Check that `target` is the one the checkpoint and its capture were made from; the draft's
    record of the target it serves, for evaluate: the one checked here (or, with
    allow_target_mismatch, the one it was told to serve); {} for a config-only target, whose
    trained-with record stays."""
    identity = target_identity(target)  # config sha256, layer count, every weight file's sha256
    if identity["fingerprint"] is None:
        print(
            f"export: target={target} holds no weight files (a config-only dir): its config is "
            "checked, its weights cannot be",
            file=sys.stderr,
            flush=True,
        )
    check_target_identity(
        meta.recorded_target(),
        f"checkpoint {ck}",
        target,
        cfg.allow_target_mismatch,
        identity=identity,
        error=ExportError,
        redo="train again with this one",
    )
    if manifest is not None:
        check_target_identity(
            manifest.recorded_target(),
            f"capture {meta.captured}",
            target,
            cfg.allow_target_mismatch,
            identity=identity,
            error=ExportError,
        )
    if identity["fingerprint"] is None:
        return {}
    return {
        **identity_record(identity),
        "target": str(Path(target).resolve()),
        "target_num_layers": identity["num_hidden_layers"],
    }


def _check_vocab(meta: DraftMetadata, tensors: dict[str, torch.Tensor]) -> None:
    """ExportError when the vocab dir the draft was trained with was rebuilt since."""
    vocab_file = Path(meta.vocab or "") / DraftVocab.FILE
    if meta.vocab and vocab_file.is_file():
        d2t = DraftVocab.load(meta.vocab).torch_maps()[0]
        if d2t.shape != tensors["d2t"].shape or not torch.equal(d2t, tensors["d2t"].long()):
            raise ExportError(
                f"the checkpoint's d2t differs from {vocab_file} (vocab={meta.vocab}): the vocab "
                "dir was rebuilt "
                "after training; export the checkpoint as trained by restoring that vocab or "
                "re-train"
            )


def _served_tensors(tensors: dict[str, torch.Tensor], dcfg: DraftConfig) -> dict[str, torch.Tensor]:
    """The draft's tensors as vLLM loads them: bfloat16 weights, int64 d2t, bool t2d; with equal
    vocabularies no mapping, the lm_head rows in target-id order instead."""
    out_t = {
        k: (v if k in ("d2t", "t2d") else v.to(torch.bfloat16)).contiguous()
        for k, v in tensors.items()
    }
    out_t["d2t"], out_t["t2d"] = out_t["d2t"].long(), out_t["t2d"].bool()
    if dcfg.draft_vocab_size == dcfg.vocab_size:
        # vLLM keeps no d2t buffer when the vocabularies are equal (and fails on an unexpected d2t
        # key): put lm_head rows in target-id order instead and drop the mapping
        order = torch.arange(dcfg.draft_vocab_size) + out_t.pop(
            "d2t"
        )  # (Vd,) target id of each draft row
        out_t.pop("t2d")
        head = torch.empty_like(out_t["lm_head.weight"])  # (V, H)
        head[order] = out_t["lm_head.weight"]
        out_t["lm_head.weight"] = head
    return out_t
