"""Progress of a running stage read from the files it writes (the libraries print no per-step
lines): train's logs/metrics.jsonl (step / max_steps, or epoch / epochs) and capture's progress.json
(samples done / samples to capture). Each probe returns a fraction in [0, 1] or None."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Probe = Callable[[], float | None]


def _last_json_line(path: Path, tail_bytes: int = 8192) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(0, size - tail_bytes))
        lines = f.read().decode(errors="replace").strip().splitlines()
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            return rec
    return None


def train_probe(cfg: Any) -> Probe:
    path = Path(cfg.out) / "logs" / "metrics.jsonl"

    def probe() -> float | None:
        rec = _last_json_line(path)
        if not rec:
            return None
        if cfg.max_steps and isinstance(rec.get("step"), int | float):
            return min(1.0, rec["step"] / cfg.max_steps)
        if isinstance(rec.get("epoch"), int | float) and cfg.epochs:
            return min(1.0, rec["epoch"] / cfg.epochs)
        return None

    return probe


def capture_probe(cfg: Any) -> Probe:
    out = Path(cfg.out)
    total: list[int] = []

    def probe() -> float | None:
        if not total:
            try:
                n = int(json.loads((Path(cfg.data) / "manifest.json").read_text())["num_samples"])
            except (OSError, KeyError, ValueError, TypeError):
                return None
            total.append(min(n, cfg.limit) if cfg.limit else n)
        try:
            shards = json.loads((out / "progress.json").read_text()).get("shards") or []
        except (OSError, ValueError):
            return None
        if not shards or not total[0]:
            return None
        return min(1.0, shards[-1].get("next_index", 0) / total[0])

    return probe


PROBES: dict[str, Callable[[Any], Probe]] = {"train": train_probe, "capture": capture_probe}


def make_probe(stage: str, cfg: Any) -> Probe | None:
    factory = PROBES.get(stage)
    return factory(cfg) if factory else None
