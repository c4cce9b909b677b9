"""On-disk format of a capture directory: safetensors shards + progress.json + manifest.json.

Layout::

    out/
      shard-00000.safetensors   # tokens of consecutive samples, concatenated
      shard-00001.safetensors
      progress.json             # completed shards with sha256 (rewritten atomically per shard)
      manifest.json             # written last: its presence means the capture is complete

Tensors in each shard (N = tokens in the shard, S = samples, A = number of aux layers, H = hidden):
    input_ids          int64   [N]
    loss_mask          int8    [N]
    aux_hidden_states  dtype   [N, A, H]   (aux id k = output of decoder layer k-1, hidden+residual)
    last_hidden_states dtype   [N, H]      (output of the last decoder layer, before the final norm)
    sample_offsets     int64   [S + 1]     (sample j = rows sample_offsets[j]:sample_offsets[j+1])
    sample_index       int64   [S]         (row of the sample in the prepared dataset)
and the sample ids (strings) as JSON in the safetensors metadata key ``sample_ids``.
With ``storage_dtype = "fp8"`` the two state tensors are float8_e4m3fn and each has a float32 scale
per row and layer (see eagle3.quant):
    aux_hidden_states_scale   float32 [N, A]   aux_hidden_states  ~= fp8 * scale[..., None]
    last_hidden_states_scale  float32 [N]      last_hidden_states ~= fp8 * scale[..., None]
The readers (`iter_shards`, `load_captured`) dequantize fp8 shards to bfloat16 and drop the scales,
so consumers see the same keys for every storage dtype (`iter_shards(..., dequantize=False)` gives
the raw fp8 values and scales). The manifest's `storage` entry records the encoding and the scale
layout. No pickle anywhere: safetensors + JSON only. Every file is written under a temp name and
renamed, and hashed (sha256) while it is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.artifacts import CaptureManifest, ShardEntry
from eagle3.console import format_bytes
from eagle3.io import atomic_path, corrupt_file_errors, read_json, sha256_file, write_json
from eagle3.quant import FP8_MAX, FP8_READ_DTYPE, STORAGE_TORCH_DTYPES, Stored, dequantize_fp8

FORMAT = CaptureManifest.FORMAT
MANIFEST = CaptureManifest.FILE
PROGRESS = CaptureManifest.PROGRESS_FILE
LAYER_SEMANTICS = (
    "aux id k = output of decoder layer k-1 (hidden_states + residual) = transformers "
    "output_hidden_states[k]; stored in the order of `aux_layer_ids`"
)
LAST_SEMANTICS = (
    "output of the last decoder layer (hidden_states + residual), before the final norm"
)

#: storage_dtype -> dtype of the stored state tensors (fp8: float8_e4m3fn + float32 scales)
TORCH_DTYPES = STORAGE_TORCH_DTYPES
SCALE_KEYS = {
    "aux_hidden_states": "aux_hidden_states_scale",
    "last_hidden_states": "last_hidden_states_scale",
}


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.safetensors"


def bytes_per_token(num_aux: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes one captured token takes on disk: (A + 1) states of H values + int64 id + int8 mask,
    plus (A + 1) float32 scales for fp8."""
    item = torch.empty((), dtype=TORCH_DTYPES[storage_dtype]).element_size()
    scales = (num_aux + 1) * 4 if storage_dtype == "fp8" else 0
    return (num_aux + 1) * hidden_size * item + scales + 8 + 1


def storage_info(storage_dtype: str) -> dict[str, Any]:
    """The manifest's description of how states are stored (and what the reader returns)."""
    if storage_dtype == "fp8":
        return {
            "dtype": "float8_e4m3fn",
            "scales": {
                "aux_hidden_states": {
                    "key": SCALE_KEYS["aux_hidden_states"],
                    "dtype": "float32",
                    "shape": "[N, A]",
                },
                "last_hidden_states": {
                    "key": SCALE_KEYS["last_hidden_states"],
                    "dtype": "float32",
                    "shape": "[N]",
                },
            },
            "scale_layout": "per token, per layer: one float32 scale per row of H values",
            "scale_rule": f"scale = max(|x|) over H / {FP8_MAX:g}; x ~= float(fp8) * scale",
            "reader_dtype": str(FP8_READ_DTYPE).removeprefix("torch."),
        }
    return {"dtype": storage_dtype, "scales": None, "reader_dtype": storage_dtype}


@dataclass
class ShardBuffer:
    """Samples accumulated for the next shard, plus the skips seen while filling it."""

    first_index: int
    next_index: int
    input_ids: list[torch.Tensor] = field(default_factory=list)
    loss_mask: list[torch.Tensor] = field(default_factory=list)
    aux: list[torch.Tensor] = field(default_factory=list)
    last: list[torch.Tensor] = field(default_factory=list)
    aux_scale: list[torch.Tensor] = field(default_factory=list)
    last_scale: list[torch.Tensor] = field(default_factory=list)
    sample_index: list[int] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    skipped: dict[str, int] = field(default_factory=dict)
    num_tokens: int = 0

    def add(
        self,
        index: int,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux: torch.Tensor,
        last: torch.Tensor,
        aux_scale: torch.Tensor | None = None,
        last_scale: torch.Tensor | None = None,
    ) -> None:
        self.input_ids.append(input_ids.to(torch.int64))  # [T]
        self.loss_mask.append(loss_mask.to(torch.int8))  # [T]
        self.aux.append(aux)  # [T, A, H]
        self.last.append(last)  # [T, H]
        if aux_scale is not None:
            self.aux_scale.append(aux_scale)  # [T, A] float32
            self.last_scale.append(last_scale)  # [T] float32
        self.sample_index.append(index)
        self.sample_ids.append(sample_id)
        self.num_tokens += int(input_ids.shape[0])
        self.next_index = index + 1

    def add_stored(
        self,
        index: int,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        st: Stored,
        num_aux: int,
    ) -> None:
        """Add one sample from its storage form (states [T, A+1, H]: aux in order, then last)."""
        sc = st.scales  # [T, A+1] or None
        self.add(
            index,
            sample_id,
            input_ids,
            loss_mask,
            st.states[:, :num_aux],
            st.states[:, num_aux],
            None if sc is None else sc[:, :num_aux],
            None if sc is None else sc[:, num_aux],
        )

    def skip(self, index: int, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        self.next_index = index + 1


#: torch dtype -> (safetensors dtype name, rank in safetensors' Dtype enum: its writer orders by it,
#: descending)
ST_DTYPES = {
    torch.uint8: ("U8", 4),
    torch.int8: ("I8", 5),
    torch.float8_e4m3fn: ("F8_E4M3", 7),
    torch.float16: ("F16", 11),
    torch.bfloat16: ("BF16", 12),
    torch.float32: ("F32", 15),
    torch.int64: ("I64", 18),
}


@contextlib.contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch ops on one thread inside the block (restored after).

    The driver's shard assembly is pure memory copying: with torch's default OpenMP team every
    copy above the grain size enters a barrier, which costs seconds per shard when the cores are
    oversubscribed (measured: cat of 400 sample views 0.07 s on 1 thread vs 0.3-2.8 s on 2)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _safetensors_header(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None
) -> tuple[list[str], bytes]:
    """(tensor order, padded header JSON) of safetensors' layout."""
    order = sorted(tensors, key=lambda k: (-ST_DTYPES[tensors[k].dtype][1], k))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = metadata
    off = 0
    for k in order:
        t = tensors[k]
        header[k] = {
            "dtype": ST_DTYPES[t.dtype][0],
            "shape": list(t.shape),
            "data_offsets": [off, off + t.nbytes],
        }
        off += t.nbytes
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return order, head + b" " * (-len(head) % 8)


def safetensors_nbytes(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> int:
    """Exact size of the file `save_safetensors_hashed(tensors, ..., metadata)` writes."""
    return (
        8 + len(_safetensors_header(tensors, metadata)[1]) + sum(t.nbytes for t in tensors.values())
    )


def save_safetensors_hashed(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> str:
    """Write `tensors` (CPU) as a safetensors file at `path`, hashing the bytes as they are written;
    return the file's sha256 (no second read of the file).

    Same layout as safetensors' own writer (header JSON with ``__metadata__`` first, tensors ordered
    by dtype, largest first, then name; header padded with spaces to 8 bytes), so the file is
    byte-identical to ``safetensors.torch.save`` up to the order of metadata keys, which safetensors
    takes from a hash map (checked in the tests). Readers are safetensors' own."""
    order, head = _safetensors_header(tensors, metadata)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(head).to_bytes(8, "little"), head):
            h.update(chunk)
            f.write(chunk)
        for k in order:
            t = tensors[k]
            if t.nbytes == 0:
                continue
            mv = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())  # zero-copy bytes
            h.update(mv)
            f.write(mv)
    return h.hexdigest()


def write_shard(
    out: Path,
    shard_id: int,
    buf: ShardBuffer,
    num_aux: int = 0,
    hidden_size: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    before_write: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write `buf` as shard `shard_id` atomically; return its progress entry (with sha256).

    num_aux/hidden_size/dtype only give the shapes of an empty shard (every sample skipped); fp8
    (`dtype` float8_e4m3fn, or scales in the buffer) adds the scale tensors. `before_write(nbytes)`
    is called with the file's exact size before its temp file is created (the streaming spool waits
    there for room).
    """
    with single_threaded():
        return _write_shard(out, shard_id, buf, num_aux, hidden_size, dtype, before_write)


def _write_shard(
    out: Path,
    shard_id: int,
    buf: ShardBuffer,
    num_aux: int,
    hidden_size: int,
    dtype: torch.dtype,
    before_write: Callable[[int], None] | None,
) -> dict[str, Any]:
    fp8 = bool(buf.aux_scale) or dtype == torch.float8_e4m3fn
    if not buf.input_ids:
        buf.input_ids = [torch.zeros(0, dtype=torch.int64)]  # [0]
        buf.loss_mask = [torch.zeros(0, dtype=torch.int8)]  # [0]
        buf.aux = [torch.zeros((0, num_aux, hidden_size), dtype=dtype)]  # [0, A, H]
        buf.last = [torch.zeros((0, hidden_size), dtype=dtype)]  # [0, H]
        if fp8:
            buf.aux_scale = [torch.zeros((0, num_aux), dtype=torch.float32)]  # [0, A]
            buf.last_scale = [torch.zeros(0, dtype=torch.float32)]  # [0]
        lengths = torch.zeros(0, dtype=torch.int64)  # [S=0]
    else:
        lengths = torch.tensor([t.shape[0] for t in buf.input_ids], dtype=torch.int64)  # [S]

    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)  # [S+1]
    torch.cumsum(lengths, 0, out=offsets[1:])
    tensors = {
        "input_ids": torch.cat(buf.input_ids),  # [N]
        "loss_mask": torch.cat(buf.loss_mask),  # [N]
        "aux_hidden_states": torch.cat(
            buf.aux
        ),  # [N, A, H]  (one copy out of the [T, A+1, H] views)
        "last_hidden_states": torch.cat(buf.last),  # [N, H]
        "sample_offsets": offsets,  # [S+1]
        "sample_index": torch.tensor(buf.sample_index, dtype=torch.int64),  # [S]
    }
    if fp8:
        tensors[SCALE_KEYS["aux_hidden_states"]] = torch.cat(buf.aux_scale)  # [N, A] float32
        tensors[SCALE_KEYS["last_hidden_states"]] = torch.cat(buf.last_scale)  # [N] float32
    name = shard_name(shard_id)
    path = out / name
    metadata = {"format": FORMAT, "sample_ids": json.dumps(buf.sample_ids)}
    nbytes = safetensors_nbytes(tensors, metadata)
    if before_write is not None:
        before_write(nbytes)
    with atomic_path(path, needed_bytes=nbytes) as tmp:
        digest = save_safetensors_hashed(tensors, tmp, metadata)
    return {
        "file": name,
        "sha256": digest,
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
            f"{p} belongs to a capture with different settings (config_hash "
            f"{prog.get('config_hash')} != {config_hash}): use a new --out directory or delete "
            f"{out} to start over"
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


def corrupt_shards(out: Path, entries: list[ShardEntry], max_threads: int = 8) -> list[str]:
    """Names of the shards in `entries` (a manifest's shards) that are missing or whose sha256
    differs from the recorded one, in order. Shards are hashed in parallel threads (hashlib
    releases the GIL): a capture is read once at disk speed."""

    def bad(entry: ShardEntry) -> bool:
        f = out / entry.file
        size = f.stat().st_size if entry.bytes is None and f.is_file() else entry.bytes
        return not f.is_file() or f.stat().st_size != size or sha256_file(f) != entry.sha256

    if not entries:
        return []
    with ThreadPoolExecutor(max(1, min(max_threads, os.cpu_count() or 1, len(entries)))) as pool:
        flags = list(pool.map(bad, entries))
    return [e.file for e, b in zip(entries, flags, strict=True) if b]


def verify_capture(path: str | Path) -> CaptureManifest:
    """Check every shard of the finished capture at `path` against the sha256 its manifest records;
    return the manifest. Raises ValueError naming the corrupt or missing shards and the fix."""
    path = Path(path)
    manifest = CaptureManifest.load(path)
    bad = corrupt_shards(path, manifest.shards)
    if bad:
        raise ValueError(
            f"capture {path}: {len(bad)} of {len(manifest.shards)} shard(s) are missing or differ "
            "from the sha256 "
            f"in {path / MANIFEST} ({', '.join(bad[:5])}{', ...' if len(bad) > 5 else ''}): the "
            "files are corrupt. Run `eagle3 capture` again with the same settings and --out "
            f"{path}: it keeps the good shards and captures the rest again"
        )
    return manifest


def save_progress(
    out: Path,
    config_hash: str,
    shards: list[dict[str, Any]],
    target_fingerprint: dict[str, Any] | None = None,
) -> None:
    """progress.json: the completed shards and what a resumed run must match (settings, target
    weights)."""
    write_json(
        out / PROGRESS,
        {
            "format": FORMAT,
            "config_hash": config_hash,
            "target_fingerprint": target_fingerprint,
            "shards": shards,
        },
    )


def read_progress(out: Path) -> dict[str, Any] | None:
    """progress.json of an interrupted capture in `out`, None when there is none."""
    return read_json(out / PROGRESS) if (out / PROGRESS).is_file() else None


# ------------------------------------------------------------------------- storage estimates + disk


@dataclass
class StorageEstimate:
    """What a capture of `num_tokens` tokens takes on disk (eagle3.plan, capture's and
    preflight's disk checks)."""

    num_aux: int
    hidden_size: int
    storage_dtype: str
    state_bytes_per_token: int  # (A + 1) x H values in the storage dtype
    #: + int64 id + int8 mask (+ fp8 scales): what one captured token takes on disk
    bytes_per_token: int
    num_tokens: int
    total_bytes: int


def estimate_storage(
    num_aux: int, hidden_size: int, storage_dtype: str, num_tokens: int
) -> StorageEstimate:
    """Disk bytes of a capture of `num_tokens` tokens (the capture's own bytes_per_token: no
    second formula)."""
    item = torch.empty((), dtype=TORCH_DTYPES[storage_dtype]).element_size()
    bpt = bytes_per_token(num_aux, hidden_size, storage_dtype)
    return StorageEstimate(
        num_aux,
        hidden_size,
        storage_dtype,
        (num_aux + 1) * hidden_size * item,
        bpt,
        int(num_tokens),
        int(bpt * num_tokens),
    )


def free_disk_bytes(path: str | Path) -> int:
    """Free bytes on the filesystem that holds `path` (its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_capture_fits(
    out: str | Path,
    est: StorageEstimate,
    min_free_gb: float,
    sample_tokens: list[int] | None = None,
) -> int:
    """Refuse (ValueError) a capture whose states cannot fit the disk at `out` with `min_free_gb`
    kept free; the message names the numbers and the fixes (fp8, streaming, fewer samples).
    Returns the free bytes."""
    free = free_disk_bytes(out)
    reserve = int(min_free_gb * 1024**3)
    if est.total_bytes + reserve <= free:
        return free
    room = free - reserve
    fixes = []
    if est.storage_dtype != "fp8":
        fp8 = estimate_storage(est.num_aux, est.hidden_size, "fp8", est.num_tokens)
        fits = "fits" if fp8.total_bytes <= room else "does not fit either"
        fixes.append(
            f"--storage-dtype fp8 ({format_bytes(fp8.total_bytes)}, {fits}; fp8 halves "
            "bfloat16, bfloat16 halves float32)"
        )
    if sample_tokens:
        n_fit, used = 0, 0
        for t in sample_tokens:
            if (used + t) * est.bytes_per_token > room:
                break
            used += t
            n_fit += 1
        fixes.append(
            f"capture fewer samples (--limit {n_fit} fits)"
            if n_fit
            else "capture fewer samples (--limit)"
        )
    else:
        fixes.append("capture fewer samples (--limit)")
    fixes.append(
        "the streaming mode (capture into a bounded spool that training drains; "
        "`eagle3 plan` recommends a spool cap)"
    )
    fixes.append("free space or choose another --out, or lower --min-free-disk-gb")
    raise ValueError(
        f"capture needs {format_bytes(est.total_bytes)} in {out} ({est.num_tokens:,} tokens x "
        f"{est.bytes_per_token:,} bytes/token: {est.num_aux} aux + 1 last layer x "
        f"H={est.hidden_size} in {est.storage_dtype}) plus CaptureConfig.min_free_disk_gb = "
        f"{min_free_gb} GB kept free, but only {format_bytes(free)} is free on that disk. Fixes: "
        + "; ".join(fixes)
    )


# ----------------------------------------------------------------------------------------- reader


def iter_shards(
    path: str | Path, verify: bool = False, dequantize: bool = True
) -> Iterator[dict[str, Any]]:
    """Yield one dict per shard: the tensors of the shard format above plus `sample_ids`
    (list[str]).

    Efficient bulk access for trainers (one safetensors load per shard). `verify=True` checks
    sha256. fp8 captures: the states are dequantized to bfloat16 and the scale tensors dropped, so
    the keys and dtypes are those of a bfloat16 capture; `dequantize=False` yields the stored
    float8_e4m3fn states with their float32 `*_scale` tensors instead (e.g. to dequantize on the
    GPU).
    """

    path = Path(path)
    manifest = CaptureManifest.load(path)
    for entry in manifest.shards:
        f = path / entry.file
        if not f.is_file():
            raise FileNotFoundError(
                f"{f} listed in {path / MANIFEST} is missing: rerun the capture"
            )
        if verify and sha256_file(f) != entry.sha256:
            raise ValueError(
                f"{f}: sha256 differs from {path / MANIFEST}; the file is corrupt, rerun the "
                "capture"
            )
        yield load_shard(f, dequantize)


def load_shard(f: str | Path, dequantize: bool = True) -> dict[str, Any]:
    """One shard file's tensors plus `sample_ids` and `file` (its path) (fp8 states dequantized to
    bfloat16 unless told not to)."""
    with corrupt_file_errors(f, "capture shard"), safe_open(str(f), framework="pt") as st:
        shard: dict[str, Any] = {k: st.get_tensor(k) for k in st.keys()}
        shard["sample_ids"] = json.loads(st.metadata()["sample_ids"])
    shard["file"] = str(f)
    if dequantize:
        for key, skey in SCALE_KEYS.items():
            if skey in shard:
                shard[key] = dequantize_fp8(shard[key], shard.pop(skey))  # bfloat16
    return shard


def shard_samples(shard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The samples of one loaded shard (views into its tensors), in order; keys as
    `load_captured`."""
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
            "shard": shard.get("file", "?"),
        }


def load_captured(path: str | Path, verify: bool = False) -> Iterator[dict[str, Any]]:
    """Yield one dict per captured sample, in prepared-dataset order.

    Keys: input_ids (int64 [T]), loss_mask (int64 [T]), aux_hidden_states ([T, A, H]),
    last_hidden_states ([T, H]), sample_id (str), sample_index (int: row in the prepared dataset).
    States come in the manifest's storage dtype, except fp8 captures, which are dequantized to
    bfloat16.
    """
    for shard in iter_shards(path, verify=verify):
        yield from shard_samples(shard)
