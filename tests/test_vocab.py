import numpy as np
import pytest

from eagle3.artifacts import DraftVocab, PreparedMeta
from eagle3.config import ConfigError, VocabConfig
from eagle3.prepared import save_prepared
from eagle3.vocab import (
    build_draft_vocab,
    count_supervised_tokens,
    coverage_at_sizes,
    run_vocab,
)


def test_counts_only_loss_masked_tokens():
    counts = count_supervised_tokens(
        [np.array([1, 2, 2, 3])], [np.array([0, 1, 1, 1])], vocab_size=5
    )
    assert counts.tolist() == [0, 0, 2, 1, 0]


def test_top_n_ties_by_id_and_offsets_round_trip():
    counts = np.array([0, 5, 3, 5, 0, 3, 1, 0, 0, 9])
    v = build_draft_vocab(counts, 4)
    # 9:9, then 1 and 3 (5 each, lower id first), then 2 (3, beats 5 by id); sorted by target id
    assert v.draft_ids.tolist() == [1, 2, 3, 9]
    assert (np.arange(4) + v.d2t).tolist() == v.draft_ids.tolist()
    assert v.t2d.nonzero()[0].tolist() == [1, 2, 3, 9]
    assert v.t2d.shape == (10,) and v.t2d.dtype == bool and v.d2t.dtype == np.int64


def test_padding_with_lowest_unused_ids():
    counts = np.array([0, 0, 7, 0, 1, 0])
    v = build_draft_vocab(counts, 4)
    assert v.draft_ids.tolist() == [0, 1, 2, 4]


def test_draft_vocab_larger_than_target_is_an_error():
    with pytest.raises(ConfigError, match="draft_vocab_size = 7 exceeds"):
        build_draft_vocab(np.ones(6, dtype=np.int64), 7)


def test_coverage_on_hand_made_table():
    counts = np.array([50, 0, 30, 15, 5])  # total 100
    cov = coverage_at_sizes(counts, [1, 2, 3, 4, 10])
    assert cov == {1: 0.5, 2: 0.8, 3: 0.95, 4: 1.0, 5: 1.0}


def test_run_vocab_writes_loadable_files(tmp_path):
    rows = [
        {"input_ids": [1, 2, 3, 3], "loss_mask": [0, 1, 1, 1], "sample_id": "a"},
        {"input_ids": [4, 3, 5], "loss_mask": [1, 1, 0], "sample_id": "b"},
    ]
    save_prepared(rows, tmp_path / "prep", PreparedMeta(target_vocab_size=8, source="x"))
    res = run_vocab(
        VocabConfig(data=str(tmp_path / "prep"), out=tmp_path / "voc", draft_vocab_size=4)
    )
    assert res.num_distinct_seen == 3 and res.num_padded == 1 and res.coverage == 1.0
    v = DraftVocab.load(tmp_path / "voc")
    assert v.draft_ids.tolist() == [0, 2, 3, 4] and v.target_vocab_size == 8
    assert (tmp_path / "voc" / "coverage.json").is_file()
