"""benchmarks/realbench/ngram_rows.py: vLLM's prompt-lookup rule and the two replays on hand-made
answers."""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "ngram_rows", Path(__file__).resolve().parents[1] / "benchmarks" / "realbench" / "ngram_rows.py"
)
ngram_rows = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ngram_rows)


def test_propose_takes_the_longest_suffix_then_its_earliest_occurrence() -> None:
    propose = ngram_rows.propose_ngram
    # suffix (7, 8) occurs at 0 and 4: the earliest wins -> the tokens after position 0's match
    assert propose([7, 8, 1, 2, 7, 8, 3, 4, 7, 8], 2, 4, 3) == [1, 2, 7]
    # a 3-token suffix (5, 7, 8) beats the earlier 2-token match (7, 8)
    assert propose([7, 8, 1, 5, 7, 8, 9, 9, 5, 7, 8], 2, 4, 3) == [9, 9, 5]
    # fewer than k tokens where the context ends; an occurrence may overlap the suffix
    assert propose([1, 1, 1], 2, 4, 3) == [1]
    # no recurring suffix of min_n tokens: no draft
    assert propose([1, 2, 3, 4, 5], 2, 4, 3) == []
    assert propose([1, 2], 2, 4, 3) == []


def test_replays_count_rounds_as_vllm_does() -> None:
    # prompt ids[0..3], answer ids[4..13]: the prefill made ids[4], so the first round sits at row 3
    # (drafting ids[5..]) and the last at row 11 (drafting ids[13])
    ids = [9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 0]
    supervised = [False] * 4 + [True] * 10
    accepts = [0] * len(ids)
    accepts[4], accepts[5], accepts[8], accepts[9] = 2, 3, 1, 1
    c = ngram_rows.replay_answer(
        ids, supervised, accepts, k=3, min_n=2, max_n=4, max_new_tokens=None
    )
    # the draft: rows 3 (0) -> 4 (2) -> 7 (0) -> 8 (1) -> 10 (0) -> 11 (0)
    assert (c["draft_rounds"], c["draft_accepted"]) == (6, 3)
    # n-gram: row 3's context (9, 1, 2, 3, 1) has no recurring suffix: one token, no draft; row 4's
    # ends (1, 2), first seen at 1 -> (3, 1, 2) = ids[6:9], 3 accepted; row 8's ends (3, 1, 2, 3),
    # seen at 3 -> (1, 2, 3) = ids[10:13]
    assert (c["ngram_steps"], c["ngram_drafts"], c["ngram_accepted"], c["ngram_tokens"]) == (
        3,
        2,
        6,
        9,
    )
    assert c["draft_on_ngram_rows_accepted"] == 2 + 1  # the draft at rows 4 and 8
    s = ngram_rows.summarize(c)
    assert (
        s["ngram_tau"] == 4.0
        and s["draft_tau_on_ngram_rows"] == 2.5
        and s["ngram_tokens_per_step"] == 3.0
    )
    # the first 3 answer tokens only: rows 3..4
    c = ngram_rows.replay_answer(ids, supervised, accepts, k=3, min_n=2, max_n=4, max_new_tokens=3)
    assert (c["draft_rounds"], c["ngram_steps"], c["ngram_drafts"]) == (2, 2, 1)


def test_a_step_without_a_match_decodes_one_token_and_counts_no_draft() -> None:
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    supervised = [False, False] + [True] * 8
    c = ngram_rows.replay_answer(
        ids, supervised, [0] * len(ids), k=3, min_n=2, max_n=4, max_new_tokens=None
    )
    assert c["ngram_drafts"] == 0 and c["ngram_steps"] == c["ngram_tokens"] == 7  # rows 1..7
    assert ngram_rows.summarize(c)["ngram_tau"] is None
