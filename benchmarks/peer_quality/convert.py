#!/usr/bin/env python3
"""Our capture directories -> the training input of the peer, speculators 0.9.0 (offline, `file`
backend).

    python benchmarks/peer_quality/convert.py --captured CAP[,CAP...] --out DIR \
        [--seed 0] [--workers 8]

What speculators 0.9.0's trainer reads from `--data-path DIR` (train/data.py ArrowDataset,
hs_connectors FileTransfer, train/cli.py parse_vocab_mappings):
  DIR/                      a `datasets` Dataset (save_to_disk), torch format, one row per sample:
                              input_ids int64 [T], loss_mask int64 [T] (1 = assistant token),
                              seq_len int
                            (the columns and dtypes of its prepare_data for pre-tokenized rows)
  DIR/hidden_states/hs_<i>.safetensors
                            row i's states: hidden_states [T, A + 1, H] (the A aux layers in the
                            draft's order, then the verifier's last decoder layer output, before
                            the final norm) and token_ids int64 [T] (must equal row i's
                            input_ids, or the sample is dropped)
  DIR/token_freq.pt         {token id: count} over the loss-masked input_ids, written by the peer's
                            own `save_token_frequency_distribution` when speculators is importable
                            (else by the same count here); the trainer turns it into d2t/t2d at
                            --draft-vocab-size
Our captures store aux states with vLLM's semantics (aux id k = output of decoder layer k-1), which
is what the peer's vLLM extraction gives for the same ids, and the last layer's output before the
final norm, which the peer normalises with the verifier's norm before its lm_head; loss_mask has the
same meaning (1 = assistant token). Both are copied unchanged, in the capture's storage dtype
(bfloat16; fp8 captures are dequantized to bfloat16, as our own reader does).

Order: the rows are a seeded permutation of all samples of all captures (the peer's prepare_data
shuffles the same way), so its train/val split, which takes the LAST rows of the dataset as
validation, is a random split rather than the tail source of a concatenation. Rows without a
supervised token are dropped (as the peer's prepare_data drops them). `DIR/conversion.json` records
the captures, counts, the permutation seed and, per row, the capture and sample id it came from
(`rows`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

HS_DIR = "hidden_states"
CONVERSION = "conversion.json"
TOKEN_FREQ = "token_freq.pt"


def hs_path(out: Path, i: int) -> Path:
    """The peer's file for dataset row i (hs_connectors.FileTransfer.get_cached)."""
    return out / HS_DIR / f"hs_{i}.safetensors"


def peer_states(sample: dict[str, Any], positions: list[int]) -> torch.Tensor:
    """[T, A + 1, H]: our aux states at `positions` (indices into the capture's aux ids), then the
    last layer's output."""
    aux, last = sample["aux_hidden_states"][:, positions], sample["last_hidden_states"]
    return torch.cat([aux, last.to(aux.dtype).unsqueeze(1)], dim=1).contiguous()


def aux_positions(captured_ids: list[int], wanted: list[int] | None) -> list[int]:
    """Indices into the capture's aux ids of the ids the peer's draft reads (all of them, in order,
    by default)."""
    if wanted is None:
        return list(range(len(captured_ids)))
    missing = [i for i in wanted if i not in captured_ids]
    if missing:
        raise SystemExit(
            f"--aux-layer-ids {wanted}: {missing} not captured (the captures hold {captured_ids}); "
            "capture them, or name a subset of those"
        )
    return [captured_ids.index(i) for i in wanted]


def _open(captured: str):
    from eagle3.train.data import load_samples

    return load_samples(captured, verify=False)


def _supervised(samples, i: int) -> bool:
    return bool(torch.as_tensor(samples[i]["loss_mask"]).any())


def _write_rows(
    args: tuple[str, str, list[int], list[tuple[int, int]]],
) -> list[tuple[int, list[int], list[int]]]:
    """Worker: write hs_<row>.safetensors for (row, sample index) pairs; returns (row, ids,
    mask)."""
    from safetensors.torch import save_file

    captured, out, positions, pairs = args
    torch.set_num_threads(1)
    samples = _open(captured)
    done = []
    for row, si in pairs:
        s = samples[si]
        ids = torch.as_tensor(s["input_ids"]).to(torch.int64).contiguous()
        path = hs_path(Path(out), row)
        tmp = path.with_name(path.name + ".tmp")
        save_file({"hidden_states": peer_states(s, positions), "token_ids": ids}, str(tmp))
        os.replace(tmp, path)
        done.append((row, ids.tolist(), torch.as_tensor(s["loss_mask"]).to(torch.int64).tolist()))
    return done


def sample_origins(captured: str) -> list[dict[str, Any]]:
    """Per sample index of the combined captures: the capture dir and sample id (conversion.json
    `rows`)."""
    from eagle3.artifacts import capture_dirs
    from eagle3.train.data import CapturedDataset

    origins = []
    for d in capture_dirs(captured):
        ds = CapturedDataset(d, verify=False)
        origins += [{"capture": str(d), "sample_id": entry[3]} for entry in ds._index]
    return origins


def write_token_freq(dataset, out: Path) -> str:
    """token_freq.pt: the peer's own counter when importable (its prepare_data default), else the
    same count."""
    path = out / TOKEN_FREQ
    path.unlink(missing_ok=True)
    try:
        from speculators.train.vocab_mapping import save_token_frequency_distribution
    except ImportError:
        freq: Counter[int] = Counter()
        for ids, mask in zip(dataset["input_ids"], dataset["loss_mask"], strict=True):
            freq.update(ids[mask.bool()].tolist())
        torch.save(dict(freq), path)
        return "counted here (speculators not importable): input_ids where loss_mask == 1"
    save_token_frequency_distribution(dataset, path)
    return "speculators.train.vocab_mapping.save_token_frequency_distribution"


def convert(
    captured: str,
    out: Path,
    seed: int = 0,
    workers: int = 8,
    limit: int | None = None,
    aux_layer_ids: list[int] | None = None,
) -> dict[str, Any]:
    import datasets

    from eagle3.artifacts import CaptureManifest

    t0 = time.time()
    manifest = CaptureManifest.load_combined(captured)
    positions = aux_positions(manifest.aux_layer_ids, aux_layer_ids)
    samples = _open(captured)
    keep = [i for i in range(len(samples)) if _supervised(samples, i)]
    dropped = len(samples) - len(keep)
    g = torch.Generator().manual_seed(seed)
    order = [keep[j] for j in torch.randperm(len(keep), generator=g).tolist()]
    if limit is not None:
        order = order[:limit]
    (out / HS_DIR).mkdir(parents=True, exist_ok=True)
    pairs = list(enumerate(order))
    chunks = [
        (captured, str(out), positions, pairs[k::workers])
        for k in range(workers)
        if pairs[k::workers]
    ]
    rows: dict[int, tuple[list[int], list[int]]] = {}
    if workers <= 1:
        results = [_write_rows(c) for c in chunks]
    else:
        with ProcessPoolExecutor(workers) as ex:
            results = list(ex.map(_write_rows, chunks))
    for part in results:
        for row, ids, mask in part:
            rows[row] = (ids, mask)
    t_states = time.time() - t0
    table = {
        "input_ids": [rows[r][0] for r in range(len(order))],
        "loss_mask": [rows[r][1] for r in range(len(order))],
        "seq_len": [len(rows[r][0]) for r in range(len(order))],
    }
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int64")),
            "loss_mask": datasets.Sequence(datasets.Value("int64")),
            "seq_len": datasets.Value("int64"),
        }
    )
    ds = datasets.Dataset.from_dict(table, features=features)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    freq_by = write_token_freq(ds, out)
    origins = sample_origins(captured)
    record = {
        "format": "speculators-0.9.0 offline training data (file backend)",
        "captured": captured,
        "seed": seed,
        "num_rows": len(order),
        "num_dropped_unsupervised": dropped,
        "num_tokens": sum(table["seq_len"]),
        "num_supervised_tokens": sum(sum(m) for m in table["loss_mask"]),
        "aux_layer_ids": [manifest.aux_layer_ids[p] for p in positions],
        "aux_positions": positions,
        "captured_aux_layer_ids": manifest.aux_layer_ids,
        "hidden_size": manifest.hidden_size,
        "hidden_states_layout": "[T, A + 1, H]: aux layers in aux_layer_ids order, then the last "
        "decoder layer's output before the final norm",
        "token_freq": freq_by,
        "seconds_states": round(t_states, 1),
        "seconds": round(time.time() - t0, 1),
        "rows": [{"row": r, **origins[si]} for r, si in enumerate(order)],
    }
    (out / CONVERSION).write_text(json.dumps(record) + "\n")
    return {k: v for k, v in record.items() if k != "rows"}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--captured", required=True, help="capture dir(s), comma-separated (as `eagle3 train`)"
    )
    ap.add_argument(
        "--out", required=True, type=Path, help="the peer's --data-path (must not exist)"
    )
    ap.add_argument("--seed", type=int, default=0, help="row permutation seed")
    ap.add_argument("--workers", type=int, default=8, help="processes writing the state files")
    ap.add_argument(
        "--limit", type=int, default=None, help="convert only the first N permuted rows"
    )
    ap.add_argument(
        "--aux-layer-ids",
        default=None,
        help="comma-separated aux ids the peer's draft reads, a subset of the captured ones, in "
        "the draft's order (default: every captured id, in the capture's order)",
    )
    args = ap.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(
            f"--out {args.out} exists and is not empty: give a new directory (the peer reads every "
            "hs_<i> file there)"
        )
    ids = [int(x) for x in args.aux_layer_ids.split(",")] if args.aux_layer_ids else None
    print(
        json.dumps(
            convert(args.captured, args.out, args.seed, args.workers, args.limit, ids), indent=1
        )
    )


if __name__ == "__main__":
    main()
