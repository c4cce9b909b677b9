"""Where the test suite's time goes: per-file sums of a pytest log's `--durations=0` lines, one or
more runs side by side.

    # one run (the README's environment: scripts/test.sh)
    .venv/bin/python -m pytest -q -p no:cacheprovider --durations=0 > /tmp/suite.log 2>&1
    .venv/bin/python benchmarks/suite_time.py --log before=/tmp/a.log --log after=/tmp/b.log \
        --out benchmarks/results/suite_time --note "2026-12-02, a 2-core CPU, ..."

Writes NAME.json (every run: wall seconds from pytest's summary, the sum of test durations, the
per-file sums and the slowest items) and NAME.md (a table of the files, longest first, one column
per run). The sum of durations over the wall time says how well the xdist workers overlap (2.0 =
both busy throughout on two workers).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result

DURATION = re.compile(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")
SUMMARY = re.compile(
    r"^=* ?(\d+ (?:passed|failed).*?) in ([\d.]+)s"
)  # with or without -q's "=" rule


def parse_log(path: Path) -> dict:
    """A pytest log -> {"wall_s", "result", "sum_s", "files": {file: s}, "slowest": [[s, phase,
    nodeid], ...]}."""
    files: Counter[str] = Counter()
    items: list[tuple[float, str, str]] = []
    wall, result = None, None
    for line in path.read_text(errors="replace").splitlines():
        if m := DURATION.match(line):
            seconds, phase, nodeid = float(m.group(1)), m.group(2), m.group(3)
            files[nodeid.split("::")[0]] += seconds
            items.append((seconds, phase, nodeid))
        elif m := SUMMARY.match(line):
            result, wall = m.group(1), float(m.group(2))
    if not items:
        raise SystemExit(f"suite_time: {path} has no duration lines: run pytest with --durations=0")
    if wall is None:
        raise SystemExit(
            f"suite_time: {path} has no final summary line ('N passed ... in S s'): was the run "
            "cut off?"
        )
    total = sum(files.values())
    return {
        "log": str(path),
        "result": result,
        "wall_s": wall,
        "sum_s": round(total, 1),
        "overlap": round(total / wall, 2),
        "files": {f: round(s, 1) for f, s in files.most_common()},
        "slowest": [[s, p, n] for s, p, n in sorted(items, reverse=True)[:20]],
    }


def render(runs: dict[str, dict], note: str) -> str:
    names = list(runs)
    order = Counter()
    for r in runs.values():
        order.update(r["files"])
    lines = [
        f"# Test suite time: {', '.join(names)}",
        "",
        note,
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for key, label in (
        ("wall_s", "**pytest wall s**"),
        ("sum_s", "sum of test durations s"),
        ("overlap", "overlap"),
    ):
        lines.append(f"| {label} | " + " | ".join(str(runs[n][key]) for n in names) + " |")
    lines.append("| result | " + " | ".join(runs[n]["result"] for n in names) + " |")
    for f, _ in order.most_common():
        lines.append(
            f"| {f} | " + " | ".join(str(runs[n]["files"].get(f, 0.0)) for n in names) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--log",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a run's pytest log (repeat)",
    )
    ap.add_argument(
        "--out", required=True, help="output path without suffix: writes OUT.json and OUT.md"
    )
    ap.add_argument(
        "--note",
        default="",
        help="date, machine, commit and command of the runs (goes into both files)",
    )
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.log:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(
                f"suite_time: --log {spec!r}: expected NAME=PATH, e.g. --log before=/tmp/suite.log"
            )
        runs[name] = parse_log(Path(path))
    write_result(Path(args.out), {"note": args.note, "runs": runs}, render(runs, args.note))
    print(render(runs, args.note), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
