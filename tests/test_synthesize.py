"""synthesize (prompts the target writes itself), mix (sources by weight) and their place in the
pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3.chat_formats import read_conversations
from eagle3.config import (
    ConfigError,
    MixConfig,
    PipelineConfig,
    PrepareConfig,
    RegenerateConfig,
    SynthesizeConfig,
)
from eagle3.data.mix import run_mix
from eagle3.data.synthesize import (
    DROP_REASONS,
    NearDuplicateIndex,
    check_text,
    domain_quotas,
    end_of_user_turn,
    normalize,
    repeated_fraction,
    run_synthesize,
    user_turn_prefix,
)

SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
#: SmolLM2-135M-Instruct's chat template, verbatim
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
    "'<|im_start|>system\n"
    + SMOLLM2_SYSTEM
    + "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' "
    "}}{% endif %}"
)


def _tok(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def test_user_turn_prefix_on_smollm2_chatml(tiny_chatml):
    tok = _tok(tiny_chatml)
    tok.chat_template = SMOLLM2_TEMPLATE
    assert (
        user_turn_prefix(tok)
        == f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    )
    assert user_turn_prefix(tok, "You help programmers.") == (
        "<|im_start|>system\nYou help programmers.<|im_end|>\n<|im_start|>user\n"
    )
    assert end_of_user_turn(tok) == tok.convert_tokens_to_ids("<|im_end|>")


def test_user_turn_prefix_on_another_template(tiny_llama):
    tok = _tok(tiny_llama)  # <|system|>..<|end|><|user|>..<|end|>
    assert user_turn_prefix(tok) == "<|user|>"
    assert user_turn_prefix(tok, "S") == "<|system|>S<|end|><|user|>"
    assert end_of_user_turn(tok) == tok.convert_tokens_to_ids("<|end|>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"  # no special token ends a turn
    )
    with pytest.raises(ValueError, match="special token"):
        end_of_user_turn(tok)


def test_filters_name_each_reason():
    cfg = SynthesizeConfig(min_chars=10, max_chars=80)
    ok = "Write a Python function that reverses a linked list."
    assert check_text(ok, "stop", cfg) is None
    assert check_text(ok, "length", cfg) == "truncated"
    assert check_text("", "stop", cfg) == "empty"
    assert check_text("Hi there", "stop", cfg) == "too_short"
    assert check_text(ok * 2, "stop", cfg) == "too_long"
    assert check_text("{}[]()<>=+-*/ 12345 67890", "stop", cfg) == "non_text"
    assert check_text("a b\ufffd c d e f g h i j k", "stop", cfg) == "non_text"
    assert check_text("go on go on go on go on go on go on", "stop", cfg) == "repetitive"
    assert repeated_fraction("one two three four five six seven") == 0.0
    assert normalize("  Hello,   WORLD!! ") == "hello world"


def test_near_duplicates_found_and_distinct_texts_kept():
    idx = NearDuplicateIndex(0.7, seed=0)
    assert idx.add_if_new(
        normalize("Write a Python function that reverses a linked list in place.")
    )
    assert not idx.add_if_new(
        normalize("Write a Python function which reverses a linked list in place!")
    )
    assert idx.add_if_new(
        normalize("Explain the causes of the French Revolution in three paragraphs.")
    )


def test_domain_quotas_follow_weights():
    cfg = SynthesizeConfig(
        num_prompts=10, domains={"a": {"weight": 1}, "b": {"weight": 2}, "c": {"weight": 2}}
    )
    assert domain_quotas(cfg) == {"a": 2, "b": 4, "c": 4}
    cfg = SynthesizeConfig(num_prompts=7, domains="coding,math,writing")
    assert sum(domain_quotas(cfg).values()) == 7 and set(domain_quotas(cfg)) == {
        "coding",
        "math",
        "writing",
    }


def test_config_and_cli(tmp_path):
    from eagle3.cli import build_parser, stage_config_from_args

    args = build_parser().parse_args(
        ["synthesize", "--domains", "coding,math", "--num-prompts", "5"]
    )
    cfg = stage_config_from_args("synthesize", args)
    assert list(cfg.domains) == ["coding", "math"] and cfg.domains["coding"].system.startswith(
        "You are an AI"
    )
    with pytest.raises(ConfigError, match="not default domains"):
        stage_config_from_args(
            "synthesize", build_parser().parse_args(["synthesize", "--domains", "cooking"])
        )
    custom = SynthesizeConfig(
        domains='{"cooking": {"system": "Users ask about recipes.", "seeds": ["How do I"]}}'
    )
    assert custom.domains["cooking"].seeds == ["How do I"]
    import yaml

    pipe = tmp_path / "pipe.yaml"  # a pipeline config without `data` is still read as one
    pipe.write_text(
        yaml.safe_dump({"target": "T", "work_dir": str(tmp_path), "synthesize": {"enabled": True}})
    )
    cfg = stage_config_from_args(
        "synthesize", build_parser().parse_args(["synthesize", "--config", str(pipe)])
    )
    assert cfg.out == tmp_path / "synthesized" and cfg.target == "T"
    mix = stage_config_from_args(
        "mix", build_parser().parse_args(["mix", "--sources", "a.jsonl=1,b.jsonl=2.5,c.jsonl"])
    )
    assert [(s.path, s.weight) for s in mix.sources] == [
        ("a.jsonl", 1.0),
        ("b.jsonl", 2.5),
        ("c.jsonl", 1.0),
    ]


def _check_accounting(res, cfg):
    m = res.manifest
    c = m["counts"]
    assert set(c["dropped"]) == set(DROP_REASONS)
    assert c["kept"] + sum(c["dropped"].values()) + c["surplus"] == c["generated"]
    for name, d in m["per_domain"].items():
        assert d["kept"] + sum(d["dropped"].values()) + d["surplus"] == d["generated"], name
    rows = [json.loads(x) for x in res.prompts_path.read_text().splitlines()]
    assert len(rows) == c["kept"] == res.num_prompts
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in rows)
    assert {r["category"] for r in rows} <= set(cfg.domains)
    assert len({normalize(r["messages"][0]["content"]) for r in rows}) == len(rows)
    assert all(cfg.min_chars <= len(r["messages"][0]["content"]) <= cfg.max_chars for r in rows)
    read = read_conversations(res.prompts_path, require_assistant=False)
    assert not read.skipped and [x.category for x in read.conversations] == [
        r["category"] for r in rows
    ]
    return rows


@pytest.mark.slow
def test_synthesize_hf_backend(tiny_chatml, tmp_path):
    cfg = SynthesizeConfig(
        target=str(tiny_chatml),
        out=tmp_path / "synth",
        num_prompts=6,
        domains="coding,math",
        max_new_tokens=16,
        min_chars=8,
        batch_size=8,
        backend="hf",
        device="cpu",
        seed=1,
    )
    res = run_synthesize(cfg)
    rows = _check_accounting(res, cfg)
    assert res.num_prompts == 6 and res.per_domain == {"coding": 3, "math": 3}
    assert (
        res.dropped.get("truncated", 0) > 0
        and res.dropped.get("empty", 0) + res.dropped.get("too_short", 0) > 0
    )
    assert (
        res.manifest["engine"]["backend"] == "hf"
        and res.manifest["template"]["end_of_user_turn"] == "<|im_end|>"
    )
    again = run_synthesize(cfg)  # same settings: the finished output is reused
    assert (
        again.manifest == res.manifest
        and [json.loads(x) for x in res.prompts_path.read_text().splitlines()] == rows
    )
    with pytest.raises(ValueError, match="other settings"):
        run_synthesize(cfg.model_copy(update={"seed": 2}))


@pytest.fixture(scope="module")
def chatml_llm(tiny_chatml):
    pytest.importorskip("vllm")
    from vllm import LLM

    from eagle3.vllm_engine import engine_kwargs, setup_cpu_env, shutdown_engine

    setup_cpu_env()
    engine = LLM(
        **engine_kwargs(
            str(tiny_chatml), dtype="float32", max_model_len=512, enable_prefix_caching=True
        )
    )
    yield engine
    shutdown_engine(engine)


@pytest.mark.vllm
@pytest.mark.slow
def test_synthesize_vllm_then_mix_regenerate_prepare(tiny_chatml, chatml_llm, tmp_path):
    """The data path of a pipeline with synthesize: prompts by vLLM, mixed 2:1 with the user's
    chats, answered by regenerate (category kept), tokenized by prepare."""
    from eagle3.data.prepare import run_prepare
    from eagle3.data.regenerate import run_regenerate
    from eagle3.testing.tiny import tiny_conversations

    cfg = SynthesizeConfig(
        target=str(tiny_chatml),
        out=tmp_path / "synth",
        num_prompts=16,
        max_new_tokens=24,
        min_chars=8,
        batch_size=32,
        seed=0,
    )
    res = run_synthesize(cfg, llm=chatml_llm)
    _check_accounting(res, cfg)
    assert (
        res.num_prompts == 16
        and len(res.per_domain) == 8
        and res.manifest["engine"]["model"] == str(tiny_chatml)
    )

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in tiny_conversations(num=20, seed=1)))
    mixed = run_mix(
        MixConfig(
            sources=[
                {"path": str(chats), "weight": 1},
                {"path": str(res.prompts_path), "weight": 2},
            ],
            out=tmp_path / "mixed",
        )
    )
    assert mixed.num_rows == 24 and [s["taken"] for s in mixed.per_source] == [
        8,
        16,
    ]  # 16 synthesized rows bound it
    regen = run_regenerate(
        RegenerateConfig(
            target=str(tiny_chatml),
            data=str(mixed.conversations_path),
            out=tmp_path / "regen",
            max_new_tokens=16,
            max_model_len=512,
        ),
        llm=chatml_llm,
    )
    rows = [json.loads(x) for x in regen.conversations_path.read_text().splitlines()]
    synth_rows = [r for r in rows if r["id"].startswith("1/")]
    assert synth_rows and all(
        r["category"] in cfg.domains and r["messages"][-1]["role"] == "assistant"
        for r in synth_rows
    )
    prep = run_prepare(
        PrepareConfig(
            target=str(tiny_chatml), data=str(regen.conversations_path), out=tmp_path / "prep"
        )
    )
    # every regenerated turn is trained as generated: one row per conversation, or one per turn
    # where a turn's ids are not how the template re-tokenizes its text (cut at max_new_tokens)
    num_turns = sum(m["role"] == "assistant" for r in rows for m in r["messages"])
    assert prep.turns["from_generated"] == num_turns
    assert len(rows) <= prep.num_samples <= num_turns


def test_mix_counts_errors_and_defaults(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text(
        "".join(json.dumps({"question": f"q{i}", "category": "x"}) + "\n" for i in range(10))
    )
    b.write_text(
        "".join(json.dumps({"question": f"p{i}"}) + "\n" for i in range(30)) + "not json\n"
    )
    res = run_mix(MixConfig(sources=f"{a}=1,{b}=1", out=tmp_path / "m"))
    assert res.num_rows == 20 and [s["taken"] for s in res.per_source] == [
        10,
        10,
    ]  # a (10 rows, half) bounds it
    assert res.per_source[1]["skipped"] == {"invalid_json": 1}
    rows = [json.loads(x) for x in res.conversations_path.read_text().splitlines()]
    assert len({r["id"] for r in rows}) == 20 and sum(r.get("category") == "x" for r in rows) == 10
    res = run_mix(MixConfig(sources=f"{a}=1,{b}=3", out=tmp_path / "m2", num_rows=12, seed=1))
    assert [s["taken"] for s in res.per_source] == [3, 9]
    with pytest.raises(ConfigError, match=r"sources\[0\].*has 10 usable rows.*num_rows <= 13"):
        run_mix(MixConfig(sources=f"{a}=3,{b}=1", out=tmp_path / "m3", num_rows=20))


def test_pipeline_wires_synthesize_and_mix(tmp_path):
    from eagle3.pipeline import enabled_stages

    base = {"target": "T", "work_dir": str(tmp_path)}
    both = PipelineConfig(
        **base, data="chats.jsonl", synthesize={"enabled": True}, mix={"synthesize_weight": 3}
    )
    r = both.resolved()
    assert [(s.path, s.weight) for s in r.mix.sources] == [
        ("chats.jsonl", 1.0),
        (str(tmp_path / "synthesized" / "prompts.jsonl"), 3.0),
    ]
    assert (
        r.regenerate.data == str(tmp_path / "mixed" / "conversations.jsonl")
        and r.synthesize.target == "T"
    )
    assert r.resolved().mix.sources == r.mix.sources  # resolving twice adds nothing
    assert enabled_stages(both)[:3] == ["synthesize", "mix", "regenerate"]
    only = PipelineConfig(**base, synthesize={"enabled": True})
    assert only.resolved().regenerate.data == str(tmp_path / "synthesized" / "prompts.jsonl")
    assert enabled_stages(only)[:2] == ["synthesize", "regenerate"]
    plain = PipelineConfig(**base, data="chats.jsonl")
    assert (
        plain.resolved().regenerate.data == "chats.jsonl"
        and enabled_stages(plain)[0] == "regenerate"
    )
    extra = PipelineConfig(**base, data="chats.jsonl", mix={"sources": "more.jsonl=0.5"})
    assert [s.path for s in extra.resolved().mix.sources] == ["chats.jsonl", "more.jsonl"]
    assert enabled_stages(extra)[0] == "mix"
    with pytest.raises(ValueError, match="needs regenerate.enabled"):
        PipelineConfig(**base, synthesize={"enabled": True}, regenerate={"enabled": False})
    with pytest.raises(ValueError, match="data is not set"):
        PipelineConfig(**base)
    assert Path(r.mix.out) == tmp_path / "mixed"
