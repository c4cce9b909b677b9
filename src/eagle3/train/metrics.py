"""What a training run reports while it runs: logs/metrics.jsonl (one record per log/eval event),
tb/ (TensorBoard scalars, when tensorboard is installed), curves.png at the end, and progress lines
on stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eagle3.io import atomic_path


class MetricsLog:
    """logs/metrics.jsonl and tb/ of one training run. A run that resumes from a checkpoint repeats
    the steps the interrupted run logged after that checkpoint: its first record (step S) drops
    every earlier record of step >= S from metrics.jsonl, and TensorBoard's event files are written
    again from the kept records, so neither holds a step twice."""

    def __init__(self, out: Path, enabled: bool):
        self.enabled, self.out = enabled, out
        self.tb = None
        self._started = False
        if enabled:
            (out / "logs").mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path:
        return self.out / "logs" / "metrics.jsonl"

    def _start(self, step: int) -> None:
        """Before the first record of this run (at `step`): drop what a lost run logged from `step`
        on."""
        self._started = True
        kept, dropped = [], []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by the crash
                    dropped.append(None)
                    continue
                (dropped if rec.get("step", -1) >= step else kept).append(rec)
        if dropped:
            steps = [r["step"] for r in dropped if r is not None]
            span = f" of steps {min(steps)}..{max(steps)}" if steps else ""
            print(
                f"train: metrics.jsonl: dropped {len(dropped)} record(s){span} that an "
                f"interrupted run wrote after its last checkpoint; this run logs from step "
                f"{step}",
                file=sys.stderr,
                flush=True,
            )
            with atomic_path(self.path) as tmp:
                Path(tmp).write_text("".join(json.dumps(r) + "\n" for r in kept))
        tb_dir = self.out / "tb"
        rewrite_tb = bool(dropped) and tb_dir.is_dir()
        if rewrite_tb:  # the old event files hold the dropped steps: the kept ones go to a new file
            for f in tb_dir.glob("events.out.tfevents.*"):
                f.unlink()
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(tb_dir))
        except Exception:  # tensorboard missing: JSONL + PNG still written
            self.tb = None
        if rewrite_tb and self.tb is not None:
            for rec in kept:
                self._add_scalars(rec["step"], rec.get("split", "train"), rec)

    def _add_scalars(self, step: int, split: str, metrics: dict) -> None:
        for k, v in metrics.items():
            numeric = isinstance(v, int | float) and not isinstance(v, bool)
            if numeric and k not in ("step", "split"):
                self.tb.add_scalar(f"{split}/{k}", v, step)

    def log(self, step: int, split: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if not self._started:
            self._start(step)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "split": split, **metrics}) + "\n")
        if self.tb is not None:
            self._add_scalars(step, split, metrics)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.enabled:
            plot_curves(self.path, self.out / "curves.png")


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
