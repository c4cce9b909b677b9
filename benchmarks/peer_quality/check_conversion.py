#!/usr/bin/env python3
"""Check a conversion exactly: the peer's own data loader returns our tensors, bit for bit.

    python benchmarks/peer_quality/check_conversion.py --converted DIR [--num-rows 8] [--out FILE]

For a few rows (the first, the last and evenly spaced ones between) it builds speculators 0.9.0's
`ArrowDataset` over the converted directory (its default `file` transfer, `on_missing="raise"`),
takes its `__getitem__` (what its DataLoader workers return before collation) and compares, with
`torch.equal`, against the same sample read through our reader (`eagle3.train.data.load_samples`
over the captures named in conversion.json):
  hidden_states                [T, A * H] == our aux_hidden_states [T, A, H] (the converted ids)
                               flattened
  verifier_last_hidden_states  [T, H]     == our last_hidden_states
  input_ids                    [T]        == our input_ids
  loss_mask                    [T]        == our loss_mask
and that the peer's shift_batch (its Eagle-3 preprocess) drops one row of each, as its collation
expects. Prints (and writes to --out) a JSON verdict; exits 1 on any difference, naming the row, key
and shapes. Needs speculators 0.9.0 and hs-connectors 0.9.0 importable (the GPU run installs them
from wheels).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))


def pick_rows(num_rows_total: int, num: int) -> list[int]:
    if num_rows_total <= num:
        return list(range(num_rows_total))
    step = (num_rows_total - 1) / (num - 1)
    return sorted({round(k * step) for k in range(num)})


def ours_by_origin(captured: str) -> tuple[Any, dict[tuple[str, str], int]]:
    """Our combined samples and (capture dir, sample id) -> index in them."""
    from eagle3.artifacts import capture_dirs
    from eagle3.train.data import CapturedDataset, load_samples

    index, base = {}, 0
    for d in capture_dirs(captured):
        ds = CapturedDataset(d, verify=False)
        for j, entry in enumerate(ds._index):
            index[(str(d), entry[3])] = base + j
        base += len(ds)
    return load_samples(captured, verify=False), index


def check(converted: Path, num_rows: int = 8) -> dict[str, Any]:
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset

    record = json.loads((converted / "conversion.json").read_text())
    peer = ArrowDataset(
        max_len=8192,
        datapath=str(converted),
        on_missing="raise",
        train_ratio=1.0,
        split="train",
        hidden_states_dtype=torch.bfloat16,
    )
    ours, index = ours_by_origin(record["captured"])
    rows = pick_rows(len(peer), num_rows)
    problems, checked = [], []
    for r in rows:
        origin = record["rows"][r]
        s = ours[index[(origin["capture"], origin["sample_id"])]]
        got = peer[r]
        if not isinstance(got, dict):
            problems.append(f"row {r}: the peer's loader returned {got!r} (sample unavailable)")
            continue
        positions = record.get("aux_positions") or list(range(len(record["aux_layer_ids"])))
        want = {
            "hidden_states": torch.as_tensor(s["aux_hidden_states"])[:, positions].flatten(1),
            "verifier_last_hidden_states": torch.as_tensor(s["last_hidden_states"]),
            "input_ids": torch.as_tensor(s["input_ids"]).to(torch.int64),
            "loss_mask": torch.as_tensor(s["loss_mask"]).to(torch.int64),
        }
        for key, w in want.items():
            g = got[key]
            if g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g, w):
                problems.append(
                    f"row {r} ({origin['capture']}:{origin['sample_id']}) {key}: peer "
                    f"{tuple(g.shape)} {g.dtype} != ours {tuple(w.shape)} {w.dtype}"
                )
        shifted = shift_batch(got)
        T = want["input_ids"].shape[0]
        if shifted["input_ids"].shape[0] != T - 1 or int(shifted["lengths"][0]) != T - 1:
            problems.append(
                f"row {r}: shift_batch gave {shifted['input_ids'].shape[0]} rows for T = {T}"
            )
        checked.append(
            {"row": r, **origin, "num_tokens": T, "num_supervised": int(want["loss_mask"].sum())}
        )
    return {
        "converted": str(converted),
        "num_rows_in_dataset": len(peer),
        "rows_checked": checked,
        "equal": not problems,
        "problems": problems,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--converted", required=True, type=Path)
    ap.add_argument("--num-rows", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    verdict = check(args.converted, args.num_rows)
    text = json.dumps(verdict, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    sys.exit(0 if verdict["equal"] else 1)


if __name__ == "__main__":
    main()
