"""read_conversations / read_prompts: every input type and row format, and every skip reason."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from eagle3.chat_formats import (
    Conversation,
    ReadResult,
    iter_prompts,
    read_conversations,
    read_prompts,
)

SHAREGPT = {
    "id": "sg-1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "value": "Hi"},
        {"from": "gpt", "value": "Hello!"},
        {"from": "user", "value": "And?"},
        {"from": "chatgpt", "value": "That's all."},
    ],
}
OPENAI = {
    "messages": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": [{"type": "text", "text": "4"}]},
    ]
}
PAIRS = [
    {"question": "q1", "answer": "a1"},
    {"prompt": "p2", "response": "r2"},
    {"prompt": "p3", "completion": "c3"},
    {"instruction": "i4", "input": "x4", "output": "o4"},
]


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_all_row_formats_jsonl(tmp_path):
    res = read_conversations(_jsonl(tmp_path / "d.jsonl", [SHAREGPT, OPENAI, *PAIRS]))
    assert isinstance(res, ReadResult) and res.num_rows == 6 and not res.skipped
    sg, oa, q, p, c, i = res.conversations
    assert isinstance(sg, Conversation) and sg.sample_id == "sg-1"
    assert [m["role"] for m in sg.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert sg.messages[4] == {"role": "assistant", "content": "That's all."}
    assert oa.sample_id == "row-1" and oa.messages[1]["content"] == "4"
    assert q.messages == [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}]
    assert p.messages[1]["content"] == "r2" and c.messages[1]["content"] == "c3"
    assert i.messages[0]["content"] == "i4\n\nx4" and i.messages[1]["content"] == "o4"
    assert res.formats == {"sharegpt": 1, "openai": 1, "pair": 4}


def test_json_list_and_limit(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([SHAREGPT, OPENAI, *PAIRS]))
    assert len(read_conversations(p).conversations) == 6
    res = read_conversations(p, limit=2)
    assert res.num_rows == 2 and [c.sample_id for c in res.conversations] == ["sg-1", "row-1"]


def test_json_that_is_jsonl(tmp_path):
    p = _jsonl(tmp_path / "d.json", PAIRS)
    assert len(read_conversations(p).conversations) == 4


def test_skip_reasons_counted(tmp_path, caplog):
    rows = [
        PAIRS[0],
        "{not json",
        ["a", "list"],
        {"foo": 1},
        {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"question": "no answer"},
        {"messages": [{"role": "assistant", "content": "hi"}]},
        PAIRS[1],
    ]
    with caplog.at_level(logging.WARNING):
        res = read_conversations(_jsonl(tmp_path / "d.jsonl", rows))
    assert res.num_rows == 10 and len(res.conversations) == 2
    assert res.skipped == {
        "invalid_json": 1,
        "not_a_mapping": 1,
        "missing_fields": 1,
        "unknown_role": 1,
        "empty_content": 1,
        "no_assistant_turn": 2,
        "no_user_turn": 1,
    }
    assert res.num_skipped == 8
    # the invalid line is named by its line number, the unknown role by its value
    assert "line 2" in res.skip_examples["invalid_json"][0]
    assert "'wizard'" in res.skip_examples["unknown_role"][0]
    assert "line 2" in caplog.text
    # sample ids of kept rows follow the row index in the file
    assert [c.sample_id for c in res.conversations] == ["row-0", "row-9"]


def test_prompt_only_rows_allowed_without_assistant(tmp_path):
    p = _jsonl(
        tmp_path / "d.jsonl",
        [{"question": "q"}, {"prompt": "p"}, {"messages": [{"role": "user", "content": "u"}]}],
    )
    with pytest.raises(ValueError, match="no usable conversations"):
        read_conversations(p)
    res = read_conversations(p, require_assistant=False)
    assert [c.messages for c in res.conversations] == [
        [{"role": "user", "content": "q"}],
        [{"role": "user", "content": "p"}],
        [{"role": "user", "content": "u"}],
    ]
    assert res.formats["prompt"] == 2


def test_zero_usable_rows_names_input(tmp_path):
    p = _jsonl(tmp_path / "bad.jsonl", [{"foo": 1}, "nope"])
    with pytest.raises(ValueError) as e:
        read_conversations(p)
    msg = str(e.value)
    assert (
        "bad.jsonl" in msg
        and "missing_fields=1" in msg
        and "invalid_json=1" in msg
        and "messages" in msg
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl"):
        read_conversations(empty)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_conversations(tmp_path / "missing.jsonl")
    txt = tmp_path / "d.txt"
    txt.write_text("x")
    with pytest.raises(ValueError, match="unsupported input type"):
        read_conversations(txt)


def test_hf_dataset_dirs(tmp_path):
    import datasets

    rows = [{"question": f"q{i}", "answer": f"a{i}"} for i in range(5)]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "ds"))
    assert len(read_conversations(tmp_path / "ds").conversations) == 5
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(
        str(tmp_path / "dd")
    )
    assert len(read_conversations(tmp_path / "dd", split="test").conversations) == 2
    with pytest.raises(ValueError, match="no split 'validation'.*test"):
        read_conversations(tmp_path / "dd", split="validation")
    # a directory of data files (load_dataset on a local path)
    (tmp_path / "files").mkdir()
    _jsonl(tmp_path / "files" / "train.jsonl", [SHAREGPT, OPENAI])
    res = read_conversations(tmp_path / "files")
    assert [c.sample_id for c in res.conversations] == ["sg-1", "row-1"]
    # in-memory datasets and lists
    assert len(read_conversations(ds, limit=3).conversations) == 3
    assert len(read_conversations([SHAREGPT]).conversations) == 1


def test_prompts_cut_before_first_assistant(tmp_path):
    p = _jsonl(
        tmp_path / "d.jsonl",
        [
            SHAREGPT,
            {"question": "q"},
            {
                "messages": [
                    {"role": "assistant", "content": "hi"},
                    {"role": "user", "content": "u"},
                ]
            },
        ],
    )
    res = read_prompts(p)
    assert res.skipped == {"no_user_turn": 1}
    assert res.conversations[0].messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert res.conversations[1].messages == [{"role": "user", "content": "q"}]
    assert [c.sample_id for c in iter_prompts(p, limit=1)] == ["sg-1"]


def test_refbench_files(refbench):
    sg = read_conversations(refbench / "data" / "sharegpt_sample.json")
    assert sg.num_rows == 500 and len(sg.conversations) + sg.num_skipped == 500
    assert sg.formats == {"sharegpt": len(sg.conversations)}
    ev = read_prompts(refbench / "data" / "gsm8k_eval200.jsonl")
    assert len(ev.conversations) == 200 and ev.conversations[0].messages[0]["role"] == "user"
