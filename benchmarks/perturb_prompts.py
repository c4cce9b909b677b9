"""Validation prompts the refbench target never trained on: GSM8K-train questions with every number
changed.

The refbench target was trained on GSM8K-train, so its greedy answers to those exact questions are
close to memorised (low entropy); a validation split of them overstates acceptance on unseen
questions (docs/history/, refbench quality run). Changing the numbers keeps the task and style but
breaks the memorised answer, which is what the 200 test questions look like to the target. Used for
validation and checkpoint selection only, never as training data, so the protocol's training set is
unchanged.

    python benchmarks/perturb_prompts.py --data ../shared/refbench/data/gsm8k_train.jsonl \
        --num 400 --out FILE

Augmented training prompts (a documented deviation from the refbench protocol's training set, see
docs/history/): `--from-start --num 7173 --seed 1` perturbs the first 7,173 rows, so no question
shares its source row with the 300 validation prompts (the last 300 rows).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?")


def perturb_number(text: str, rng: random.Random, max_value: int | None = None) -> str:
    if "," in text:
        return f"{int(perturb_number(text.replace(',', ''), rng)):,}"
    if "." in text:
        whole, frac = text.split(".")
        return f"{perturb_number(whole, rng)}.{''.join(rng.choice('0123456789') for _ in frac)}"
    n = int(text)
    lo, hi = max(1, n // 2), max(n * 2, n + 5)
    if max_value is not None:
        lo, hi = min(lo, max_value - 1), min(hi, max_value)
    new = n
    while new == n:
        new = rng.randint(lo, hi)
    return str(new)


def perturb_question(question: str, rng: random.Random) -> str:
    def repl(m: re.Match) -> str:
        percent = question[m.end() : m.end() + 1] == "%"  # keep percentages at most 100
        return perturb_number(m.group(0), rng, 100 if percent and "." not in m.group(0) else None)

    return NUMBER.sub(repl, question)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="GSM8K-style .jsonl with `question`")
    ap.add_argument(
        "--num", type=int, default=400, help="number of prompts (taken from the end of the file)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--from-start", action="store_true", help="take the first --num rows instead of the last"
    )
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rows = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()]
    rng = random.Random(a.seed)
    picked, changed = [], 0
    for row in rows[: a.num] if a.from_start else rows[-a.num :]:
        q = perturb_question(row["question"], rng)
        changed += q != row["question"]
        picked.append({"question": q})
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in picked))
    tmp.replace(out)
    print(json.dumps({"out": str(out), "num_prompts": len(picked), "num_changed": changed}))


if __name__ == "__main__":
    main()
