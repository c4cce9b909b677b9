import json

import pytest
from tests.remote_code import remote_code_target

from eagle3.artifacts import PreparedMeta
from eagle3.chat_formats import Conversation
from eagle3.chat_template import ChatRenderer
from eagle3.config import PrepareConfig
from eagle3.data.prepare import conversation_rows, load_tokenizer, run_prepare
from eagle3.prepared import load_prepared

SINGLE = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
]
MULTI = SINGLE + [
    {"role": "user", "content": "And three?"},
    {"role": "assistant", "content": "Six."},
]
SYSTEM = [{"role": "system", "content": "Be brief."}, *MULTI]


def _masked_text(tok, ids, mask, value=1):
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m == value])


def _one_row(target, messages):
    rows = conversation_rows(ChatRenderer(target), messages)
    assert len(rows) == 1  # a prefix-stable template: the whole conversation is one row
    return rows[0]


@pytest.mark.parametrize("messages", [SINGLE, MULTI, SYSTEM], ids=["single", "multi", "system"])
def test_golden_masks(tiny_llama, messages):
    tok = load_tokenizer(str(tiny_llama))
    ids, mask = _one_row(tiny_llama, messages)
    expected = "".join(m["content"] + "<|end|>" for m in messages if m["role"] == "assistant")
    assert _masked_text(tok, ids, mask) == expected
    unmasked = _masked_text(tok, ids, mask, value=0)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in unmasked
    assert "<|assistant|>" in unmasked  # the role tag is context, not a target


@pytest.mark.parametrize("messages", [SINGLE, MULTI, SYSTEM], ids=["single", "multi", "system"])
def test_generation_markers_change_nothing(tiny_llama, tiny_llama_plain, messages):
    """The template with `{% generation %}` markers and the one without give the same rows: the
    turns come from prompt renderings, not from markers."""
    gen_tok, plain_tok = load_tokenizer(str(tiny_llama)), load_tokenizer(str(tiny_llama_plain))
    assert (
        "{% generation %}" not in plain_tok.chat_template
        and "{% generation %}" in gen_tok.chat_template
    )
    assert _one_row(tiny_llama_plain, messages) == _one_row(tiny_llama, messages)


def test_template_that_rewrites_history_gives_a_row_per_turn(tiny_llama_plain):
    """A template that renders earlier turns differently from the turn being generated (as
    reasoning templates drop or empty earlier reasoning) is no error: each assistant turn is its
    own row, with the history exactly as the template renders it at that point."""
    renderer = ChatRenderer(tiny_llama_plain)
    renderer.tokenizer.chat_template = (
        "{%- for m in messages -%}{%- if loop.last -%}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
        "{%- else -%}<|{{ m['role'] }}|>{{ m['content'][:3] }}<|end|>{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
    )
    tok = renderer.tokenizer
    rows = conversation_rows(renderer, MULTI)
    assert len(rows) == 2
    (ids1, mask1), (ids2, mask2) = rows
    assert _masked_text(tok, ids1, mask1) == "It is four.<|end|>"
    assert _masked_text(tok, ids2, mask2) == "Six.<|end|>"
    # the second row's context is the history as the template renders it: "It " of turn one
    assert _masked_text(tok, ids2, mask2, value=0) == (
        "<|user|>Wha<|end|><|assistant|>It <|end|><|user|>And three?<|end|><|assistant|>"
    )


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_run_prepare_counts_every_skip_reason(tiny_llama, tmp_path):
    long_user = "word " * 400
    rows = [
        {
            "id": "ok-sharegpt",
            "conversations": [
                {"from": "human", "value": "hi"},
                {"from": "gpt", "value": "hello there"},
            ],
        },
        {"id": "ok-openai", "messages": SYSTEM},
        {"id": "ok-pair", "question": "2+2?", "answer": "4"},
        {"id": "no-fields", "text": "just text"},
        {"id": "no-assistant", "messages": [{"role": "user", "content": "hi"}]},
        {
            "id": "empty",
            "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],
        },
        {
            "id": "bad-role",
            "messages": [
                {"role": "wizard", "content": "hi"},
                {"role": "assistant", "content": "x"},
            ],
        },
        {
            "id": "too-long",
            "messages": [
                {"role": "user", "content": long_user},
                {"role": "assistant", "content": "ok"},
            ],
        },
        "{not json",
    ]
    data = _write_jsonl(tmp_path / "chats.jsonl", rows)
    res = run_prepare(
        PrepareConfig(
            target=str(tiny_llama),
            data=str(data),
            out=tmp_path / "prep",
            max_seq_len=128,
            max_skipped_fraction=1,
        )
    )  # 6 of 9 skipped
    assert res.num_samples == 3
    assert res.skipped == {
        "empty_content": 1,
        "invalid_json": 1,
        "missing_fields": 1,
        "no_assistant_turn": 1,
        "no_supervised_tokens_after_truncation": 1,
        "unknown_role": 1,
    }
    ds = load_prepared(tmp_path / "prep")
    assert list(ds["sample_id"]) == ["ok-sharegpt", "ok-openai", "ok-pair"]
    man = PreparedMeta.load(tmp_path / "prep")
    assert man.mask_method == "turn_ids"
    assert man.num_supervised_tokens == sum(int(m.sum()) for m in ds["loss_mask"])
    assert man.chat_template_sha256 and man.tokenizer_sha256 and man.source_sha256


def test_zero_usable_rows_is_an_error_naming_the_input(tiny_llama, tmp_path):
    data = _write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match="bad.jsonl"):
        run_prepare(PrepareConfig(target=str(tiny_llama), data=str(data), out=tmp_path / "prep"))
    assert not (tmp_path / "prep").exists()


def test_sharegpt_sample_from_refbench(refbench, tmp_path):
    res = run_prepare(
        PrepareConfig(
            target=str(refbench / "target-a-llama"),
            data=str(refbench / "data" / "sharegpt_sample.json"),
            out=tmp_path / "prep",
            max_seq_len=1024,
        )
    )
    assert res.num_samples > 400 and res.num_supervised_tokens > 0


def test_conversation_type_is_shared():
    assert Conversation(sample_id="a", messages=SINGLE).messages[1]["role"] == "assistant"


def test_remote_code_tokenizer_needs_opt_in(tiny_llama, tmp_path):
    """A target whose tokenizer is its own Python code (tokenizer_config.json `auto_map`, as
    Kimi-K2.5 ships a tiktoken tokenizer): refused by default with the field to set; with
    `trust_remote_code: true` that code runs."""
    from eagle3.config import ConfigError, load_pipeline_config

    target = remote_code_target(tiny_llama, tmp_path)
    data = _write_jsonl(tmp_path / "chats.jsonl", [{"id": "a", "messages": SINGLE}])
    cfg = PrepareConfig(target=str(target), data=str(data), out=tmp_path / "prep")
    assert cfg.trust_remote_code is False
    with pytest.raises(
        ConfigError,
        match=r"tokenization_tiny\.TinyRemoteTokenizer.*prepare\.trust_remote_code: true",
    ):
        run_prepare(cfg)
    assert not (tmp_path / "prep").exists()
    assert (
        type(load_tokenizer(str(target), trust_remote_code=True)).__name__ == "TinyRemoteTokenizer"
    )
    res = run_prepare(cfg.model_copy(update={"trust_remote_code": True}))
    assert res.num_samples == 1
    assert PreparedMeta.load(tmp_path / "prep").config["trust_remote_code"] is True
    # the pipeline file's key, as the error message names it
    pipe = tmp_path / "pipe.yaml"
    pipe.write_text(
        f"target: {target}\ndata: {data}\nwork_dir: {tmp_path / 'w'}\nprepare:\n  "
        "trust_remote_code: true\n"
    )
    assert load_pipeline_config(pipe).prepare.trust_remote_code is True


def test_a_text_turn_cut_at_max_new_tokens_is_trained_without_an_end(tiny_llama):
    """A text turn that says it was cut (`finish_reason: length`, as regenerate writes it) is
    trained as the target wrote it: no end-of-turn token after it, and nothing to refuse."""
    from eagle3.chat_template import ChatRenderer

    renderer = ChatRenderer(tiny_llama)
    tok = renderer.tokenizer
    cut = [SINGLE[0], {**SINGLE[1], "finish_reason": "length"}]
    ((ids, mask),) = conversation_rows(renderer, cut)
    assert _masked_text(tok, ids, mask) == "It is four."
    ((ids, mask),) = conversation_rows(renderer, SINGLE)
    assert _masked_text(tok, ids, mask) == "It is four.<|end|>"
