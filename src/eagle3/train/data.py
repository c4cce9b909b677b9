"""Captured samples -> document-aware packed batches, with a resumable position.

A sample is a dict: input_ids (T,) int64, loss_mask (T,), aux_hidden_states (T, n_aux, Ht),
last_hidden_states (T, Ht), sample_id str (the format of `eagle3.capture.load_captured`); after
`attach_target_argmax` also target_argmax (T,) int32, the target's full-vocab argmax at each row.

Order: samples are split once into train/val by a seeded permutation; every epoch visits the train
indices in a fresh seeded permutation (seed + epoch), packing greedily in that order into rows of
`max_seq_len` tokens (a sample longer than a row is truncated). The loader's position is (epoch,
cursor) with cursor = next index into that epoch's permutation, so resume is exact.
"""

from __future__ import annotations

import bisect
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3.artifacts import CaptureManifest, capture_dirs
from eagle3.errors import TokenRangeError
from eagle3.io import corrupt_file_errors
from eagle3.quant import dequantize_fp8
from eagle3.shards import SCALE_KEYS, iter_shards, shard_samples, verify_capture
from eagle3.train.loss import compute_target_argmax
from eagle3.train.step import PackedBatch


class CapturedDataset(Sequence):
    """Random access to a capture dir's samples without loading it: shards are memory-mapped
    safetensors (eagle3.shards layout) and a sample reads only its own rows. `verify`: check
    every shard's sha256 against the manifest first (a corrupt capture is refused, naming the
    shards, before anything trains on it)."""

    def __init__(self, path: str | Path, verify: bool = True):
        self.path = Path(path)
        self.manifest = verify_capture(self.path) if verify else CaptureManifest.load(self.path)
        self._files, self._index, self._handles = [], [], {}
        self._lock = threading.Lock()  # the loader's packing threads share the open shards
        for si, entry in enumerate(self.manifest.shards):
            f = self.path / entry.file
            if not f.is_file():
                raise FileNotFoundError(
                    f"{f} listed in {self.path}/manifest.json is missing: rerun the capture"
                )
            self._files.append(f)
            with (
                corrupt_file_errors(
                    f, "capture shard", "run `eagle3 capture` again with the same --out"
                ),
                safe_open(str(f), framework="pt") as h,
            ):
                off = h.get_tensor("sample_offsets").tolist()
                ids = json.loads(h.metadata()["sample_ids"])
            self._index += [
                (si, off[j], off[j + 1], sid) for j, sid in enumerate(ids) if off[j + 1] > off[j]
            ]

    def __len__(self) -> int:
        return len(self._index)

    #: shards kept open at once (the loader's packing threads read samples of neighbouring batches)
    MAX_OPEN_SHARDS = 8

    def _handle(self, si: int):
        with self._lock:
            h = self._handles.pop(si, None)
            if h is None:
                h = safe_open(str(self._files[si]), framework="pt")
            self._handles[si] = h  # most recently used last
            while len(self._handles) > self.MAX_OPEN_SHARDS:
                del self._handles[next(iter(self._handles))]
            return h

    def num_tokens(self, i: int) -> int:
        """Sample i's length, without reading it (the loader plans batches from lengths alone)."""
        _, a, b, _ = self._index[i]
        return b - a

    def sample_ids(self) -> list[str]:
        """Every sample's id, in order, without reading a sample."""
        return [sid for *_, sid in self._index]

    def __getitem__(self, i: int) -> dict[str, Any]:
        si, a, b, sid = self._index[i]
        h = self._handle(si)
        return {
            "input_ids": h.get_slice("input_ids")[a:b],  # (T,)
            "loss_mask": h.get_slice("loss_mask")[a:b],  # (T,)
            "aux_hidden_states": self._states(h, "aux_hidden_states", a, b),  # (T, A, H)
            "last_hidden_states": self._states(h, "last_hidden_states", a, b),  # (T, H)
            "sample_id": sid,
            "shard": str(self._files[si]),
        }

    def last_hidden_states(self, i: int) -> torch.Tensor:
        """Sample i's (T, Ht) last hidden states alone (attach_target_argmax reads only these)."""
        si, a, b, _ = self._index[i]
        return self._states(self._handle(si), "last_hidden_states", a, b)

    @staticmethod
    def _states(h, key: str, a: int, b: int) -> torch.Tensor:
        """Rows a:b of a state tensor; fp8 captures are dequantized with their per-token scales (to
        bfloat16, as eagle3.capture.load_captured returns them): the stored fp8 values alone are off
        by the scale."""
        x = h.get_slice(key)[a:b]
        if x.dtype == torch.float8_e4m3fn:
            x = dequantize_fp8(x, h.get_slice(SCALE_KEYS[key])[a:b])
        return x

    def find_token_out_of_range(self, vocab_size: int) -> tuple[str, str, int, int] | None:
        """(shard file, sample id, token id, position in the sample) of the first token id outside
        0..vocab_size-1, or None; reads each shard's input_ids once (8 bytes per token, not the
        states)."""
        for si, f in enumerate(self._files):
            h = self._handle(si)
            ids = h.get_tensor("input_ids")  # (N,)
            bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
            if bad.numel():
                at = int(bad[0])
                off = h.get_tensor("sample_offsets")  # (S+1,)
                j = int(torch.searchsorted(off, torch.tensor(at), right=True)) - 1
                sid = json.loads(h.metadata()["sample_ids"])[j]
                return f.name, sid, int(ids[at]), at - int(off[j])
        return None


class ConcatSamples(Sequence):
    """Several sample sequences read as one, in order (captures made in parallel or added later)."""

    def __init__(self, parts: list[Sequence[dict[str, Any]]]):
        self.parts = parts
        self._ends = list(
            itertools.accumulate(len(p) for p in parts)
        )  # exclusive end index of each part

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect.bisect_right(self._ends, i)
        return self.parts[k][i - (self._ends[k - 1] if k else 0)]

    def last_hidden_states(self, i: int) -> torch.Tensor:
        k = bisect.bisect_right(self._ends, i)
        return read_last_hidden(self.parts[k], i - (self._ends[k - 1] if k else 0))

    def num_tokens(self, i: int) -> int:
        k = bisect.bisect_right(self._ends, i)
        return sample_num_tokens(self.parts[k], i - (self._ends[k - 1] if k else 0))


def load_samples(
    source: str | Path | Iterable[dict[str, Any]], verify: bool = True
) -> Sequence[dict[str, Any]]:
    """A capture dir, or several comma-separated ones (random access, memory-mapped), or any
    iterable of sample dicts, as a sequence. A sequence is used as is; a plain iterator (e.g.
    eagle3.capture.load_captured) is materialised. Several dirs are checked to agree
    (CaptureManifest.load_combined) before reading."""
    if isinstance(source, (str, Path)):
        dirs = capture_dirs(source)
        if len(dirs) == 1:
            return CapturedDataset(dirs[0], verify)
        CaptureManifest.load_combined(source)
        return ConcatSamples([CapturedDataset(d, verify) for d in dirs])
    if isinstance(source, Sequence):
        return source
    return list(source)


class SelectedLayers(Sequence):
    """Samples whose aux states are a subset of the captured ones, in the given order.

    `captured` are the capture's aux ids (manifest `aux_layer_ids`); id `num_hidden_layers` (the
    last decoder layer's output, which vLLM's EAGLE-3 can also feed the draft) is read from
    `last_hidden_states`. One capture of many layers thus serves a sweep over layer sets without
    capturing again."""

    def __init__(
        self,
        samples: Sequence[dict[str, Any]],
        captured: list[int],
        aux_layer_ids: list[int],
        num_hidden_layers: int,
    ):
        avail = list(captured) + [num_hidden_layers]
        missing = [k for k in aux_layer_ids if k not in avail]
        if missing:
            raise ValueError(
                f"TrainConfig.aux_layer_ids = {list(aux_layer_ids)}: id(s) {missing} were not "
                f"captured (captured aux ids {list(captured)}, plus {num_hidden_layers} = the last "
                "layer); capture them or pick from those"
            )
        self.samples, self.aux_layer_ids = samples, list(aux_layer_ids)
        self._cols = [avail.index(k) for k in aux_layer_ids]
        self._last = len(captured)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        s = dict(self.samples[i])
        aux = torch.as_tensor(s["aux_hidden_states"])  # (T, A, H)
        if self._last in self._cols:
            aux = torch.cat(
                [aux, torch.as_tensor(s["last_hidden_states"])[:, None]], dim=1
            )  # (T, A+1, H)
        s["aux_hidden_states"] = aux[:, self._cols]  # (T, len(aux_layer_ids), H)
        return s

    def last_hidden_states(self, i: int) -> torch.Tensor:
        return read_last_hidden(self.samples, i)

    def num_tokens(self, i: int) -> int:
        return sample_num_tokens(self.samples, i)


def find_token_out_of_range(
    samples: Sequence[dict[str, Any]], vocab_size: int
) -> tuple[str, str, int, int] | None:
    """(shard, sample id, token id, position) of the first input token id outside the target's
    vocabulary (0.. vocab_size-1) in `samples`, or None. A capture dir is checked shard by shard
    (its input_ids only); other sequences sample by sample."""
    if isinstance(samples, CapturedDataset):
        return samples.find_token_out_of_range(vocab_size)
    if isinstance(samples, ConcatSamples):
        hits = (find_token_out_of_range(p, vocab_size) for p in samples.parts)
        return next((hit for hit in hits if hit), None)
    for i in range(len(samples)):
        s = samples[i]
        ids = torch.as_tensor(s["input_ids"])
        bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
        if bad.numel():
            at = int(bad[0])
            shard = Path(s["shard"]).name if s.get("shard") else "(in memory)"
            return shard, str(s.get("sample_id", i)), int(ids[at]), at
    return None


def check_token_ids(
    samples: Sequence[dict[str, Any]], vocab_size: int, captured: Any, target: Any
) -> None:
    """TokenRangeError naming the shard, sample, id and vocabulary when a captured token id is not
    one of the target's (data prepared for another tokenizer; the states are the other target's
    too): the embedding lookup would fail mid-training with `IndexError: index out of range in
    self`, naming nothing."""
    hit = find_token_out_of_range(samples, vocab_size)
    if hit is None:
        return
    shard, sid, tok, pos = hit
    raise TokenRangeError(
        f"captured={captured}: {shard} sample {sid} holds token id {tok} (position {pos}), but "
        f"the target {target} has a vocabulary of {vocab_size} tokens (ids 0..{vocab_size - 1}): "
        "the data was prepared for another tokenizer. Prepare and capture it again with this "
        f"target (`eagle3 prepare --target {target}`, then `eagle3 capture`), or train with the "
        "target the capture was made with"
    )


def sample_num_tokens(samples: Sequence[dict[str, Any]], i: int) -> int:
    """Sample i's length, without reading its states where the sequence can."""
    if hasattr(samples, "num_tokens"):
        return samples.num_tokens(i)
    return len(samples[i]["input_ids"])


def read_last_hidden(samples: Sequence[dict[str, Any]], i: int) -> torch.Tensor:
    """Sample i's (T, Ht) last hidden states, without reading its aux states where the sequence
    can."""
    if hasattr(samples, "last_hidden_states"):
        return samples.last_hidden_states(i)
    return torch.as_tensor(samples[i]["last_hidden_states"])


class WithColumn(Sequence):
    """Samples with one more entry each: `key` = values[i] for sample i. The samples' cheap reads
    (last hidden states, token counts) pass through."""

    def __init__(self, samples: Sequence[dict[str, Any]], key: str, values: list[Any]):
        self.samples, self.key, self.values = samples, key, values

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {**self.samples[i], self.key: self.values[i]}

    def last_hidden_states(self, i: int) -> torch.Tensor:
        return read_last_hidden(self.samples, i)

    def num_tokens(self, i: int) -> int:
        return sample_num_tokens(self.samples, i)


class WithTargetArgmax(WithColumn):
    """Samples with `target_argmax` added: (T,) int32, the target's full-vocab argmax at each
    row."""

    def __init__(self, samples: Sequence[dict[str, Any]], argmax: list[torch.Tensor]):
        super().__init__(samples, "target_argmax", argmax)


def compute_sample_argmax(
    samples: Sequence[dict[str, Any]],
    head,
    device,
    indices: Iterable[int],
    chunk_tokens: int = 16384,
) -> dict[int, torch.Tensor]:
    """{i: (T_i,) int32} the target's full-vocab argmax of samples i in `indices`
    (eagle3.train.loss. compute_target_argmax, on `device` in the head's dtype, as the step would),
    reading only their last hidden states, in chunks of ~chunk_tokens rows."""
    out: dict[int, torch.Tensor] = {}
    todo: list[tuple[int, torch.Tensor]] = []

    def flush():
        x = torch.cat([h for _, h in todo]).to(
            device, head.lm_head.dtype, non_blocking=True
        )  # (n, Ht)
        am = compute_target_argmax(head, x).to("cpu", torch.int32)  # (n,)
        for (i, _), part in zip(todo, am.split([len(h) for _, h in todo]), strict=True):
            out[i] = part
        todo.clear()

    pending = 0
    for i in indices:
        todo.append((i, read_last_hidden(samples, i)))
        pending += len(todo[-1][1])
        if pending >= chunk_tokens:
            flush()
            pending = 0
    if todo:
        flush()
    return out


def attach_target_argmax(
    samples: Sequence[dict[str, Any]], head, device, chunk_tokens: int = 16384
) -> WithTargetArgmax:
    """The target's full-vocab argmax of every sample, computed once instead of in every step of
    every epoch: the step then computes only the head's draft-vocab rows. Keeps 4 bytes per token in
    RAM. (Several ranks: each computes a share, see eagle3.train.trainer.with_target_argmax.)"""
    got = compute_sample_argmax(samples, head, device, range(len(samples)), chunk_tokens)
    return WithTargetArgmax(samples, [got[i] for i in range(len(samples))])


def preload_samples(
    path: str | Path, aux_layer_ids: list[int], num_hidden_layers: int, verify: bool = True
) -> list[dict[str, Any]]:
    """A capture dir (or several comma-separated ones, in order) read into RAM shard by shard (large
    sequential reads, not page faults per sample), keeping only the aux states of `aux_layer_ids`
    (SelectedLayers semantics). RAM needed: tokens x (len(aux_layer_ids) + 1) x H x 2 B."""
    captured = CaptureManifest.load_combined(path).aux_layer_ids
    out: list[dict[str, Any]] = []
    if verify:
        for d in capture_dirs(path):
            verify_capture(d)
    for shard in (sh for d in capture_dirs(path) for sh in iter_shards(d)):
        picked = SelectedLayers(
            list(shard_samples(shard)), captured, aux_layer_ids, num_hidden_layers
        )
        for i in range(len(picked)):
            s = picked[
                i
            ]  # aux: a fresh tensor (indexed); the rest: views, cloned so the shard can be freed
            out.append(
                {
                    **s,
                    "input_ids": s["input_ids"].clone(),
                    "loss_mask": s["loss_mask"].clone(),
                    "last_hidden_states": s["last_hidden_states"].clone(),
                }
            )
        del shard, picked
    return out


def empty_row(T: int, n_aux: int, hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A row of padding only (doc -1, nothing supervised)."""
    return {
        "input_ids": torch.zeros(T, dtype=torch.long),
        "positions": torch.zeros(T, dtype=torch.long),
        "doc_ids": torch.full((T,), -1, dtype=torch.long),
        "loss_mask": torch.zeros(T, dtype=torch.bool),
        "aux": torch.zeros(T, n_aux * hidden, dtype=dtype),
        "last_hidden": torch.zeros(T, hidden, dtype=dtype),
    }


def pack(samples: list[dict[str, Any]], max_seq_len: int) -> dict[str, torch.Tensor]:
    """Concatenate samples into one row of exactly max_seq_len tokens (padding: doc -1, mask 0)."""
    batch = pack_batch([samples], max_seq_len)  # (1, T, ...)
    return {
        f: getattr(batch, f)[0] for f in batch.__dataclass_fields__ if getattr(batch, f) is not None
    }


def pack_batch(
    rows: list[list[dict[str, Any]]], max_seq_len: int, pin_memory: bool = False
) -> PackedBatch:
    """Each list of samples packed into one row of a (B, max_seq_len) batch, written in place (no
    per-row buffers, no stack copy). `pin_memory`: the hidden states are packed straight into
    page-locked memory (torch's caching host allocator), so the step's copy to the GPU is one
    asynchronous DMA."""
    B, T = len(rows), max_seq_len
    first = next(docs[0] for docs in rows if docs)
    n_aux, Ht = first["aux_hidden_states"].shape[-2:]
    dt = first["aux_hidden_states"].dtype
    out = PackedBatch(
        input_ids=torch.zeros(B, T, dtype=torch.long),
        positions=torch.zeros(B, T, dtype=torch.long),
        doc_ids=torch.full((B, T), -1, dtype=torch.long),
        loss_mask=torch.zeros(B, T, dtype=torch.bool),
        aux=torch.empty(
            B, T, n_aux * Ht, dtype=dt, pin_memory=pin_memory
        ),  # (B, T, A*Ht); padding zeroed below
        last_hidden=torch.empty(B, T, Ht, dtype=dt, pin_memory=pin_memory),  # (B, T, Ht)
    )
    if all("target_argmax" in s for docs in rows for s in docs):  # else the step computes it
        out.target_argmax = torch.full((B, T), -1, dtype=torch.long)  # (B, T)
    if all("step_weight" in s for docs in rows for s in docs):  # refine's rollouts
        K = first["step_weight"].shape[-1]
        out.step_weight = torch.zeros(B, T, K)  # (B, T, K): padding weighs 0
    for r, docs in enumerate(rows):
        a = 0
        for d, s in enumerate(docs):
            n = min(len(s["input_ids"]), T - a)
            if n <= 0:
                break
            out.input_ids[r, a : a + n] = torch.as_tensor(s["input_ids"][:n]).long()
            out.positions[r, a : a + n] = torch.arange(n)
            out.doc_ids[r, a : a + n] = d
            out.loss_mask[r, a : a + n] = torch.as_tensor(s["loss_mask"][:n]).bool()
            out.aux[r, a : a + n] = torch.as_tensor(s["aux_hidden_states"][:n]).reshape(
                n, n_aux * Ht
            )
            out.last_hidden[r, a : a + n] = torch.as_tensor(s["last_hidden_states"][:n])
            if out.target_argmax is not None:
                out.target_argmax[r, a : a + n] = s["target_argmax"][:n]
            if out.step_weight is not None:
                out.step_weight[r, a : a + n] = torch.as_tensor(s["step_weight"][:n])
            a += n
        out.aux[r, a:] = 0
        out.last_hidden[r, a:] = 0
    return out


def nonfinite_samples(rows: list[list[dict[str, Any]]]) -> str | None:
    """None when the samples' hidden states are all finite, else which samples hold NaN/inf ("<shard
    file> sample <id>", with their first bad row). The training step checks its batch on the device
    (one fused reduction, no host pass over the states); this names the samples once a check
    failed."""
    found = []
    for docs in rows:
        for s in docs:
            for key in ("aux_hidden_states", "last_hidden_states"):
                x = torch.as_tensor(s[key])
                bad = (~torch.isfinite(x)).reshape(x.shape[0], -1).any(-1).nonzero()
                if bad.numel():
                    shard = Path(s["shard"]).name if s.get("shard") else "(in memory)"
                    found.append(
                        f"{shard} sample {s.get('sample_id', '?')} ({key} row {int(bad[0])} of "
                        f"{x.shape[0]})"
                    )
                    break
    return (
        ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        if found
        else None
    )


def collate(rows: list[dict[str, torch.Tensor]]) -> PackedBatch:
    keys = [
        k for k in rows[0] if all(k in r for r in rows)
    ]  # target_argmax only when every row has it
    return PackedBatch(**{k: torch.stack([r[k] for r in rows]) for k in keys})


@dataclass
class LoaderState:
    epoch: int = 0
    cursor: int = 0


class PackedLoader:
    """Infinite, resumable iterator of PackedBatch over `indices` of `samples` (rank-sharded by
    row).

    Packing a batch is host work (reading memory-mapped shards, copying tens of MB per batch) that
    would otherwise stall a GPU step. With `prefetch` > 0 the loader plans batches in order from the
    samples' lengths alone (cheap, on the caller's thread) and `num_workers` threads pack up to
    `prefetch` of them ahead (the copies release the GIL, so the threads pack side by side); batches
    still come out in plan order, identical to prefetch=0. `pin_memory` (CUDA training) packs the
    hidden states into page-locked memory. state_dict() is the position after the last batch handed
    out, so checkpoints resume exactly. `wait_s` is the time the caller spent waiting for a batch
    (the trainer logs its share of the wall time)."""

    def __init__(
        self,
        samples,
        indices,
        max_seq_len,
        batch_size,
        seed,
        state=None,
        rank=0,
        world=1,
        prefetch=0,
        num_workers=1,
        pin_memory=False,
    ):
        self.samples, self.indices = samples, list(indices)
        self.T, self.B, self.seed = max_seq_len, batch_size, seed
        self.state = state or LoaderState()
        self.rank, self.world = rank, world
        self.prefetch, self.num_workers, self.pin_memory = prefetch, max(1, num_workers), pin_memory
        self._pool: ThreadPoolExecutor | None = None
        self._pending: deque[Future] = deque()
        self._handed = LoaderState(
            self.state.epoch, self.state.cursor
        )  # position after the last batch out
        self._order_cache: tuple[int, list[int]] | None = None
        self.wait_s = 0.0
        if not self.indices:
            raise ValueError("no training samples: lower val_fraction or capture more data")
        #: the sample indices of the last batch handed out, per row: `name_nonfinite` names the bad
        #: samples
        self.last_rows: list[list[int]] = []

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order_cache = (
                epoch,
                [self.indices[i] for i in torch.randperm(len(self.indices), generator=g).tolist()],
            )
        return self._order_cache[1]

    def _next_docs(self) -> list[int]:
        """The sample indices of the next row, from their lengths alone."""
        st = self.state
        order = self._order(st.epoch)
        docs, used = [], 0
        while True:
            if st.cursor >= len(order):
                if docs:
                    break
                st.epoch, st.cursor = st.epoch + 1, 0
                order = self._order(st.epoch)
            i = order[st.cursor]
            n = sample_num_tokens(self.samples, i)
            if docs and used + n > self.T:
                break
            docs.append(i)
            used += n
            st.cursor += 1
            if used >= self.T:
                break
        return docs

    def _plan(self) -> tuple[list[list[int]], LoaderState]:
        rows = [
            self._next_docs() for _ in range(self.B * self.world)
        ]  # every rank walks the same order
        return rows[self.rank :: self.world], LoaderState(self.state.epoch, self.state.cursor)

    def _pack(
        self, plan: tuple[list[list[int]], LoaderState]
    ) -> tuple[PackedBatch, LoaderState, list[list[int]]]:
        mine, after = plan
        return (
            pack_batch([[self.samples[i] for i in docs] for docs in mine], self.T, self.pin_memory),
            after,
            mine,
        )

    def name_nonfinite(self, rows: list[list[int]]) -> str | None:
        """Which of these samples (a batch's `last_rows`) hold NaN/inf hidden states, read again:
        the step found its batch non-finite on the device, and only then are the samples read a
        second time to name them."""
        return nonfinite_samples([[self.samples[i] for i in docs] for docs in rows])

    def epoch_progress(self) -> float:
        return self._handed.epoch + self._handed.cursor / len(self.indices)

    # the loader protocol the trainer uses (train.stream.StreamLoader implements it for a streaming
    # spool)
    def state_dict(self) -> dict[str, int]:
        """The position saved in a checkpoint's trainer_state.json."""
        return {"epoch": self._handed.epoch, "cursor": self._handed.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._pending:
            raise RuntimeError(
                "load_state_dict after batches were planned ahead; restore the position first"
            )
        self.state = LoaderState(int(state["epoch"]), int(state["cursor"]))
        self._handed = LoaderState(self.state.epoch, self.state.cursor)

    def wants_checkpoint(self) -> bool:
        """True when the data source needs a checkpoint now (a streaming spool to free space); never
        here."""
        return False

    def on_checkpoint(self, ckpt: Path) -> None:
        """Called with each checkpoint dir once written (main rank)."""

    def close(self, finished: bool) -> None:
        """End of the training call: batches packed ahead are dropped, the packing threads end."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool, self._pending = None, deque()

    def __iter__(self) -> Iterator[PackedBatch]:
        return self

    def __next__(self) -> PackedBatch:
        t0 = time.perf_counter()
        if self.prefetch <= 0:
            batch, self._handed, self.last_rows = self._pack(self._plan())
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="eagle3-pack")
            while len(self._pending) < self.prefetch:
                self._pending.append(self._pool.submit(self._pack, self._plan()))
            batch, self._handed, self.last_rows = (
                self._pending.popleft().result()
            )  # raises a packing error
        self.wait_s += time.perf_counter() - t0
        return batch


def eval_batches(samples, indices, max_seq_len, batch_size) -> list[PackedBatch]:
    """Validation batches in index order, packed the same way. The last batch is filled up with
    empty rows (all padding, no supervised token) so every batch has the training shape: a compiled
    attention kernel is then not compiled again for an odd batch size (on the GPU that cost ~30 s
    per new shape, docs/history/)."""
    rows = eval_rows(samples, indices, max_seq_len, batch_size)
    return [
        pack_batch([[samples[i] for i in docs] for docs in rows[a : a + batch_size]], max_seq_len)
        for a in range(0, len(rows), batch_size)
    ]


def eval_rows(samples, indices, max_seq_len, batch_size) -> list[list[int]]:
    """eval_batches' rows: the sample indices each packed row holds, in order (document d of a
    row is its d-th sample, `doc_ids` d in the batch), filled up to whole batches with empty
    rows."""
    rows, docs, used = [], [], 0
    for i in indices:
        n = min(sample_num_tokens(samples, i), max_seq_len)
        if docs and used + n > max_seq_len:
            rows.append(docs)
            docs, used = [], 0
        docs.append(i)
        used += n
    if docs:
        rows.append(docs)
    if rows and len(rows) % batch_size:
        rows += [[]] * (batch_size - len(rows) % batch_size)
    return rows
