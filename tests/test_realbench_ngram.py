"""benchmarks/realbench/ngram_rows.py: vLLM's prompt-lookup rule and the two replays on hand-made answers."""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "ngram_rows", Path(__file__).resolve().parents[1] / "benchmarks" / "realbench" / "ngram_rows.py")
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
    # prompt 0..3 (unsupervised), answer 4..13; row t drafts ids[t+2 ..]; the first round sits at row 5
    ids = [9, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 0]
    supervised = [False] * 4 + [True] * 10
    accepts = [0] * len(ids)
    accepts[5], accepts[9] = 3, 1  # the draft: 3 at row 5 (-> row 9), 1 at row 9 (-> row 11 = end - 3)
    c = ngram_rows.replay_answer(ids, supervised, accepts, k=3, min_n=2, max_n=4, max_new_tokens=None)
    assert (c["draft_rounds"], c["draft_accepted"]) == (3, 4)
    # n-gram: row 5's context ids[:7] ends (1, 2, 3), first seen at 1 -> proposes (1, 2, 3) = ids[7:10], all 3
    # accepted -> row 9: context ends (1, 2, 3, 1), first seen at 1 -> (2, 3, 1) vs ids[11:14] = (2, 3, 0): 2 accepted
    assert (c["ngram_drafts"], c["ngram_accepted"], c["ngram_steps"]) == (2, 5, 2)
    assert c["draft_on_ngram_rows_accepted"] == 3 + 1
    s = ngram_rows.summarize(c)
    assert s["ngram_tau"] == 3.5 and s["draft_tau_on_ngram_rows"] == 3.0
    # the first 3 answer tokens only: rows 5..6
    c = ngram_rows.replay_answer(ids, supervised, accepts, k=3, min_n=2, max_n=4, max_new_tokens=3)
    assert (c["draft_rounds"], c["ngram_drafts"]) == (1, 1)


def test_a_step_without_a_match_decodes_one_token_and_counts_no_draft() -> None:
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    supervised = [False, False] + [True] * 8
    c = ngram_rows.replay_answer(ids, supervised, [0] * len(ids), k=3, min_n=2, max_n=4, max_new_tokens=None)
    assert c["ngram_drafts"] == 0 and c["ngram_steps"] == c["ngram_tokens"] == 5  # rows 3..7
    assert ngram_rows.summarize(c)["ngram_tau"] is None
