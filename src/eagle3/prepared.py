"""The prepared-dataset format shared by prepare (writer) and capture/vocab (readers).

A prepared dataset is a directory holding a HF `datasets` dataset saved with `save_to_disk`, columns
`input_ids` (list[int]), `loss_mask` (list[int], 1 = assistant token to supervise) and `sample_id`
(str), plus `manifest.json` describing where it came from (eagle3.artifacts.PreparedMeta).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from eagle3.artifacts import PreparedMeta
from eagle3.io import atomic_dir

MANIFEST = PreparedMeta.FILE
COLUMNS = ("input_ids", "loss_mask", "sample_id")
#: a conversation whose turns need rows of their own (eagle3.data.prepare) names its second row
#: `<id>:row2`, its third `<id>:row3`, ...
ROW_ID_SEP = ":row"


def row_id(conversation_id: str, row: int) -> str:
    """The sample id of a conversation's row (0-based): `<id>` for the first, `<id>:rowN` after."""
    return conversation_id if row == 0 else f"{conversation_id}{ROW_ID_SEP}{row + 1}"


def supervised_ids_by_conversation(path: str | Path) -> dict[str, list[int]]:
    """conversation id -> the supervised ids of its rows, in order (what training learns of it)."""
    out: dict[str, list[int]] = {}
    ds = load_prepared(path)
    for sid, ids, mask in zip(ds["sample_id"], ds["input_ids"], ds["loss_mask"], strict=True):
        kept = [int(t) for t, k in zip(ids, mask, strict=True) if k]
        out.setdefault(str(sid).split(ROW_ID_SEP)[0], []).extend(kept)
    return out


def save_prepared(rows: Iterable[dict[str, Any]], out: str | Path, manifest: PreparedMeta) -> Path:
    """Write rows + manifest atomically (a half-written dataset never appears under `out`)."""
    import datasets

    rows = list(rows)
    features = datasets.Features(
        {
            "input_ids": datasets.Sequence(datasets.Value("int32")),
            "loss_mask": datasets.Sequence(datasets.Value("int8")),
            "sample_id": datasets.Value("string"),
        }
    )
    columns = {c: [r[c] for r in rows] for c in COLUMNS}
    ds = datasets.Dataset.from_dict(columns, features=features)
    out = Path(out)
    with atomic_dir(out, needed_bytes=ds.data.nbytes) as tmp:
        ds.save_to_disk(str(tmp / "data"))
        manifest.save(tmp)
    return out


def load_prepared(path: str | Path):
    """Return the prepared `datasets.Dataset` (columns input_ids, loss_mask, sample_id)."""
    import datasets

    path = Path(path)
    if not (path / MANIFEST).is_file() or not (path / "data").is_dir():
        raise FileNotFoundError(
            f"{path} is not a prepared dataset (expected {path / MANIFEST} and {path / 'data'}/): "
            "run `eagle3 prepare` first"
        )
    ds = datasets.load_from_disk(str(path / "data"))
    missing = [c for c in COLUMNS if c not in ds.column_names]
    if missing:
        raise ValueError(f"{path}: prepared dataset lacks columns {missing}")
    return ds.with_format("numpy")
