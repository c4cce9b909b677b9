"""What a training run reports while it runs: logs/metrics.jsonl (one record per log/eval event), tb/
(TensorBoard scalars, when tensorboard is installed), curves.png at the end, and progress lines on stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3.io import atomic_path


class MetricsLog:
    def __init__(self, out: Path, enabled: bool):
        self.enabled, self.out = enabled, out
        self.tb = None
        if enabled:
            (out / "logs").mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tb"))
            except Exception:  # tensorboard missing: JSONL + PNG still written
                self.tb = None

    def log(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.out / "logs" / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(f"{split}/{k}", v, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.enabled:
            plot_curves(self.out / "logs" / "metrics.jsonl", self.out / "curves.png")


def plot_curves(jsonl: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not jsonl.is_file():
        return
    recs = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for split, style in (("train", "-"), ("val", "o-")):
        rs = [r for r in recs if r["split"] == split]
        if rs:
            a.plot([r["step"] for r in rs], [r["loss"] for r in rs], style, label=f"{split} loss")
    vr = [r for r in recs if r["split"] == "val"] or [r for r in recs if r["split"] == "train"]
    j = 0
    while vr and f"acc_{j}" in vr[0]:
        b.plot([r["step"] for r in vr], [r[f"acc_{j}"] for r in vr], label=f"acc step {j}")
        j += 1
    a.set_xlabel("step"), b.set_xlabel("step"), a.legend(), b.legend(fontsize=7)
    b.set_title(f"{vr[0]['split'] if vr else ''} top-1 agreement per TTT step")
    fig.tight_layout()
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)


def progress(d, message: str) -> None:
    """One line on stderr from the main rank (training writes its metrics to logs/metrics.jsonl)."""
    if d.main:
        print(f"train: {message}", file=sys.stderr, flush=True)


