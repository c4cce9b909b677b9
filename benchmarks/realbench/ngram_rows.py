#!/usr/bin/env python3
"""The draft against n-gram on the same answer rows: does the draft lose where n-gram chooses to
draft?

    .venv/bin/python benchmarks/realbench/ngram_rows.py --draft DRAFT --captured CAP \
        --target TARGET [--max-new-tokens 96] [--k 3] [--min-n 2] [--max-n 4] [--out FILE.json]

CAP is a capture (`eagle3 capture --backend vllm`) of the target's own greedy answers to held-out
prompts (`eagle3 regenerate` then `eagle3 prepare`), so every answer token is the token vLLM's
greedy decoding produces. A goal stated as vLLM's τ compares of a draft with n-gram's, but vLLM's τ
(1 + accepted / drafts) counts only the target passes that drafted, and n-gram drafts only where the
context repeats. This script replays, per answer:

- the draft's rounds, as `eagle3 estimate` does (a round at every step; `tau`, the figure vLLM
  reports);
- n-gram's rounds: a prompt-lookup proposer with vLLM's rule (the longest suffix of the context,
  min_n..max_n tokens, that occurs earlier; its earliest occurrence; the next k tokens, fewer at the
  context's end) where a step without a match decodes one token and counts no draft (`tau` as vLLM
  counts it, and tokens per target step);
- on the rows where n-gram drafted in its own replay, the tokens the draft would have had accepted
  at the same rows.

Rows follow the capture's layout: row t pairs the target's state at token t with token t+1 and
drafts tokens t+2..t+1+k; rounds start and end where eagle3.train.estimate.replay_rounds puts them.
Category = the sample id's prefix before the first '-' (realbench's ids, e.g. "math-3"). Prints and
writes one JSON object: overall and per category.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch


def propose_ngram(context: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's prompt-lookup rule: the longest n in [min_n, max_n] whose last-n-token suffix occurs
    earlier in `context` (an occurrence may overlap the suffix, not be it); of those occurrences the
    earliest; the k tokens after it, fewer where the context ends. [] when no suffix of min_n tokens
    recurs."""
    total = len(context)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = context[total - n :]
        for start in range(0, total - n):  # start < total - n: not the suffix itself
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


def leading_matches(proposal: list[int], truth: list[int]) -> int:
    """Tokens accepted under greedy verification: the proposal's leading run equal to the target's
    tokens."""
    n = 0
    while n < len(proposal) and n < len(truth) and proposal[n] == truth[n]:
        n += 1
    return n


def replay_answer(
    ids: list[int],
    supervised: list[bool],
    draft_accepts: list[int],
    *,
    k: int,
    min_n: int,
    max_n: int,
    max_new_tokens: int | None,
) -> dict[str, Any]:
    """One answer. ids/supervised: the sample's tokens and loss mask; draft_accepts[t]: tokens the
    draft gets accepted in a round drafted at row t (0..k). Returns summed counts for the draft's
    rounds, n-gram's rounds, and the draft on n-gram's drafting rows."""
    c = {
        "draft_rounds": 0,
        "draft_accepted": 0,
        "ngram_steps": 0,
        "ngram_drafts": 0,
        "ngram_accepted": 0,
        "ngram_tokens": 0,
        "draft_on_ngram_rows_accepted": 0,
    }
    first = next((r for r, s in enumerate(supervised) if s), None)
    if first is None or first == 0:
        return c
    end = len(ids)
    while end > first and not supervised[end - 1]:
        end -= 1
    # the answer tokens are ids[first .. end-1] and row t drafts ids[t+2 ..]: the target's prefill
    # produced ids[first], so the first round drafts ids[first+1 ..] from row first - 1 (as
    # replay_rounds); the last row with an answer token to draft is end - 3
    start = first - 1
    last_row = end - 3
    if max_new_tokens is not None:
        last_row = min(last_row, start + max_new_tokens - 2)

    t = start  # the draft's rounds (eagle3.train.estimate.replay_rounds)
    while t <= last_row:
        n = draft_accepts[t]
        c["draft_rounds"] += 1
        c["draft_accepted"] += n
        t += n + 1

    t = start  # n-gram's rounds; a step without a proposal decodes one token and counts no draft
    while t <= last_row:
        proposal = propose_ngram(ids[: t + 2], min_n, max_n, k)
        truth = ids[t + 2 : min(t + 2 + k, end)]
        c["ngram_steps"] += 1
        if proposal:
            n = leading_matches(proposal, truth)
            c["ngram_drafts"] += 1
            c["ngram_accepted"] += n
            c["draft_on_ngram_rows_accepted"] += draft_accepts[t]
        else:
            n = 0
        c["ngram_tokens"] += n + 1
        t += n + 1
    return c


def summarize(c: dict[str, int]) -> dict[str, Any]:
    per = lambda a, b: round(a / b, 4) if b else None  # noqa: E731
    return {
        "draft_tau": per(c["draft_rounds"] + c["draft_accepted"], c["draft_rounds"]),
        "ngram_tau": per(c["ngram_drafts"] + c["ngram_accepted"], c["ngram_drafts"]),
        "ngram_tokens_per_step": per(c["ngram_tokens"], c["ngram_steps"]),
        "ngram_drafted_step_fraction": per(c["ngram_drafts"], c["ngram_steps"]),
        "draft_tau_on_ngram_rows": per(
            c["ngram_drafts"] + c["draft_on_ngram_rows_accepted"], c["ngram_drafts"]
        ),
        **c,
    }


@torch.no_grad()
def draft_accepts_per_sample(
    draft: Path, captured: Path, target: Path, k: int, rows_per_batch: int = 8
):
    """(sample_id, ids, supervised, accepts per row) per captured sample: the draft's TTT unroll
    over the capture, one sample per packed row, as `eagle3 estimate` runs it."""
    from eagle3.train.data import pack_batch
    from eagle3.train.estimate import load_for_replay
    from eagle3.train.step import TTTModule

    model, _, samples, head = load_for_replay(draft, captured, target)
    head = head.to(
        "cpu", torch.float32
    )  # as `eagle3 estimate` on a CPU: the target's bf16 head is emulated, and slow
    ttt = TTTModule(model).eval()
    for a in range(0, len(samples), rows_per_batch):
        group = [samples[i] for i in range(a, min(a + rows_per_batch, len(samples)))]
        batch = pack_batch([[s] for s in group], max(len(s["input_ids"]) for s in group))
        batch = batch.to("cpu", torch.float32)
        out = ttt(batch, head, steps=k, return_correct=True)
        ok = (out[2][:k] & out[3][:k]).tolist()  # (k, B, T)
        for r, s in enumerate(group):
            n_tok = len(s["input_ids"])
            accepts = []
            for t in range(n_tok):
                n = 0
                while n < k and ok[n][r][t]:
                    n += 1
                accepts.append(n)
            yield (
                str(s.get("sample_id", a + r)),
                [int(x) for x in s["input_ids"]],
                [bool(x) for x in s["loss_mask"]],
                accepts,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--draft", required=True, type=Path)
    ap.add_argument("--captured", required=True, type=Path)
    ap.add_argument("--target", required=True, type=Path)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--min-n", type=int, default=2)
    ap.add_argument("--max-n", type=int, default=4)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not (args.captured / "manifest.json").is_file():
        sys.exit(
            f"--captured {args.captured}: no manifest.json; pass the output dir of `eagle3 capture`"
        )
    per_cat: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for sid, ids, supervised, accepts in draft_accepts_per_sample(
        args.draft, args.captured, args.target, args.k
    ):
        counts = replay_answer(
            ids,
            supervised,
            accepts,
            k=args.k,
            min_n=args.min_n,
            max_n=args.max_n,
            max_new_tokens=args.max_new_tokens,
        )
        for cat in (sid.split("-")[0], "all"):
            for key, v in counts.items():
                per_cat[cat][key] += v
            per_cat[cat]["num_answers"] += 1
    result = {
        "draft": str(args.draft),
        "captured": str(args.captured),
        "k": args.k,
        "min_n": args.min_n,
        "max_n": args.max_n,
        "max_new_tokens": args.max_new_tokens,
        "categories": {cat: summarize(dict(c)) for cat, c in per_cat.items()},
    }
    text = json.dumps(result, indent=1)
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(text)
        tmp.replace(args.out)
    print(text)


if __name__ == "__main__":
    main()
