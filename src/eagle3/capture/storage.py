"""On-disk format of a capture directory: safetensors shards + progress.json + manifest.json.

Layout::

    out/
      shard-00000.safetensors   # tokens of consecutive samples, concatenated
      shard-00001.safetensors
      progress.json             # completed shards with sha256 (rewritten atomically after each shard)
      manifest.json             # written last: its presence means the capture is complete

Tensors in each shard (N = tokens in the shard, S = samples, A = number of aux layers, H = hidden):
    input_ids          int64   [N]
    loss_mask          int8    [N]
    aux_hidden_states  dtype   [N, A, H]   (aux id k = output of decoder layer k-1, hidden + residual)
    last_hidden_states dtype   [N, H]      (output of the last decoder layer, before the final norm)
    sample_offsets     int64   [S + 1]     (sample j = rows sample_offsets[j]:sample_offsets[j+1])
    sample_index       int64   [S]         (row of the sample in the prepared dataset)
and the sample ids (strings) as JSON in the safetensors metadata key ``sample_ids``.
No pickle anywhere: safetensors + JSON only. Every file is written under a temp name and renamed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3.io import atomic_path, read_json, sha256_file, write_json

FORMAT = "eagle3-capture/1"
MANIFEST = "manifest.json"
PROGRESS = "progress.json"
LAYER_SEMANTICS = (
    "aux id k = output of decoder layer k-1 (hidden_states + residual) = transformers "
    "output_hidden_states[k]; stored in the order of `layers`"
)
LAST_SEMANTICS = "output of the last decoder layer (hidden_states + residual), before the final norm"

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def bytes_per_token(num_aux: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes one captured token takes on disk: (A + 1) states of H values + int64 id + int8 mask."""
    item = torch.empty((), dtype=TORCH_DTYPES[storage_dtype]).element_size()
    return (num_aux + 1) * hidden_size * item + 8 + 1


@dataclass
class ShardBuffer:
    """Samples accumulated for the next shard, plus the skips seen while filling it."""

    first_index: int
    next_index: int
    input_ids: list[torch.Tensor] = field(default_factory=list)
    loss_mask: list[torch.Tensor] = field(default_factory=list)
    aux: list[torch.Tensor] = field(default_factory=list)
    last: list[torch.Tensor] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    num_tokens: int = 0

    def add(self, index: int, sample_id: str, input_ids: torch.Tensor, loss_mask: torch.Tensor,
            aux: torch.Tensor, last: torch.Tensor) -> None:
        self.input_ids.append(input_ids.to(torch.int64))  # [T]
        self.loss_mask.append(loss_mask.to(torch.int8))  # [T]
        self.aux.append(aux)  # [T, A, H]
        self.last.append(last)  # [T, H]
        self.sample_index.append(index)
        self.sample_ids.append(sample_id)
        self.num_tokens += int(input_ids.shape[0])
        self.next_index = index + 1

    def skip(self, index: int, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.next_index = index + 1


def write_shard(out: Path, shard_id: int, buf: ShardBuffer, num_aux: int = 0, hidden_size: int = 0,
                dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Write `buf` as shard `shard_id` atomically; return its progress entry (with sha256).

    num_aux/hidden_size/dtype only give the shapes of an empty shard (every sample skipped).
    """
    from safetensors.torch import save_file

    if not buf.input_ids:
        buf.input_ids = [torch.zeros(0, dtype=torch.int64)]  # [0]
        buf.loss_mask = [torch.zeros(0, dtype=torch.int8)]  # [0]
        buf.aux = [torch.zeros((0, num_aux, hidden_size), dtype=dtype)]  # [0, A, H]
        buf.last = [torch.zeros((0, hidden_size), dtype=dtype)]  # [0, H]
        lengths = torch.zeros(0, dtype=torch.int64)  # [S=0]
    else:
        lengths = torch.tensor([t.shape[0] for t in buf.input_ids], dtype=torch.int64)  # [S]

    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)  # [S+1]
    torch.cumsum(lengths, 0, out=offsets[1:])
    tensors = {
        "input_ids": torch.cat(buf.input_ids).contiguous(),  # [N]
        "loss_mask": torch.cat(buf.loss_mask).contiguous(),  # [N]
        "aux_hidden_states": torch.cat(buf.aux).contiguous(),  # [N, A, H]
        "last_hidden_states": torch.cat(buf.last).contiguous(),  # [N, H]
        "sample_offsets": offsets,  # [S+1]
        "sample_index": torch.tensor(buf.sample_index, dtype=torch.int64),  # [S]
    }
    name = shard_name(shard_id)
    path = out / name
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "sample_ids": json.dumps(buf.sample_ids)})
    return {
        "file": name,
        "sha256": sha256_file(path),
        "bytes": path.stat().st_size,
        "first_index": buf.first_index,
        "next_index": buf.next_index,
        "num_samples": len(buf.sample_ids),
        "num_tokens": buf.num_tokens,
        "skipped": dict(buf.skipped),
    }


def load_progress(out: Path, config_hash: str) -> list[dict[str, Any]]:
    """Completed shards of an interrupted run in `out` whose sha256 still matches.

    Anything after the first missing/corrupt shard is dropped (and deleted) so that the capture
    resumes right after the last good shard: no lost or duplicated samples.
    """
    p = out / PROGRESS
    if not p.is_file():
        return []
    prog = read_json(p)
    if prog.get("config_hash") != config_hash:
        raise ValueError(
            f"{p} belongs to a capture with different settings (config_hash {prog.get('config_hash')} != "
            f"{config_hash}): use a new --out directory or delete {out} to start over"
        )
    good: list[dict[str, Any]] = []
    for entry in prog.get("shards", []):
        f = out / entry["file"]
        if f.is_file() and sha256_file(f) == entry["sha256"]:
            good.append(entry)
        else:
            break
    keep = {e["file"] for e in good}
    for f in out.glob("shard-*.safetensors"):
        if f.name not in keep:
            f.unlink()
    return good


def save_progress(out: Path, config_hash: str, shards: list[dict[str, Any]]) -> None:
    write_json(out / PROGRESS, {"format": FORMAT, "config_hash": config_hash, "shards": shards})


# ----------------------------------------------------------------------------------------- reader


def load_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of a finished capture (layer ids, hidden size, dtype, num_samples, shards, ...)."""
    path = Path(path)
    m = path / MANIFEST
    if not m.is_file():
        hint = " (an interrupted capture: rerun `eagle3 capture` with the same --out to finish it)" if (
            path / PROGRESS).is_file() else " (run `eagle3 capture` first)"
        raise FileNotFoundError(f"{m} does not exist: {path} is not a finished capture directory{hint}")
    manifest = read_json(m)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{m}: format is {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def iter_shards(path: str | Path, verify: bool = False) -> Iterator[dict[str, Any]]:
    """Yield one dict per shard: the tensors of the shard format above plus `sample_ids` (list[str]).

    Efficient bulk access for trainers (one safetensors load per shard). `verify=True` checks sha256.
    """
    from safetensors import safe_open

    path = Path(path)
    manifest = load_manifest(path)
    for entry in manifest["shards"]:
        f = path / entry["file"]
        if not f.is_file():
            raise FileNotFoundError(f"{f} listed in {path / MANIFEST} is missing: rerun the capture")
        if verify and sha256_file(f) != entry["sha256"]:
            raise ValueError(f"{f}: sha256 differs from {path / MANIFEST}; the file is corrupt, rerun the capture")
        with safe_open(str(f), framework="pt") as st:
            shard: dict[str, Any] = {k: st.get_tensor(k) for k in st.keys()}
            shard["sample_ids"] = json.loads(st.metadata()["sample_ids"])
        yield shard


def load_captured(path: str | Path, verify: bool = False) -> Iterator[dict[str, Any]]:
    """Yield one dict per captured sample, in prepared-dataset order.

    Keys: input_ids (int64 [T]), loss_mask (int64 [T]), aux_hidden_states ([T, A, H]),
    last_hidden_states ([T, H]), sample_id (str), sample_index (int: row in the prepared dataset).
    """
    for shard in iter_shards(path, verify=verify):
        off = shard["sample_offsets"].tolist()
        for j, sid in enumerate(shard["sample_ids"]):
            s, e = off[j], off[j + 1]
            yield {
                "input_ids": shard["input_ids"][s:e],  # [T]
                "loss_mask": shard["loss_mask"][s:e].to(torch.int64),  # [T]
                "aux_hidden_states": shard["aux_hidden_states"][s:e],  # [T, A, H]
                "last_hidden_states": shard["last_hidden_states"][s:e],  # [T, H]
                "sample_id": sid,
                "sample_index": int(shard["sample_index"][j]),
            }
