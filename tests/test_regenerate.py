"""regenerate on a real vLLM engine (tiny random Llama, one engine shared by the module)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from eagle3.chat_formats import read_conversations
from eagle3.config import RegenerateConfig
from eagle3.data.regenerate import (
    PARTIAL,
    PROGRESS,
    RegenerateResult,
    generation_points,
    run_regenerate,
)

MAX_MODEL_LEN = 256
MAX_NEW = 16


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> Path:
    from eagle3.testing.tiny import tiny_conversations

    convs = tiny_conversations(num=8, seed=3, max_turns=3)
    rows: list[dict] = list(convs)
    rows.append({"id": "prompt-only", "question": "What is the time now?"})
    rows.append(
        {
            "id": "sharegpt",
            "conversations": [
                {"from": "human", "value": "Hi there"},
                {"from": "gpt", "value": "x"},
                {"from": "human", "value": "Tell me more"},
                {"from": "gpt", "value": "y"},
            ],
        }
    )
    rows.append({"id": "too-long", "question": " ".join(["word"] * 600), "answer": "a"})
    assert any(sum(m["role"] == "assistant" for m in r["messages"]) > 1 for r in convs), (
        "want multi-turn rows"
    )
    p = tmp_path_factory.mktemp("regen_data") / "chats.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


@pytest.fixture(scope="module")
def llm(tiny_llama):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from eagle3.vllm_engine import engine_kwargs, setup_cpu_env, shutdown_engine

    setup_cpu_env()
    # float32, as the hf backend runs in the test below: vLLM's "auto" serves a float32 checkpoint
    # in half precision
    # as the stage builds it (per_request_seeds), with one step's budget = one longest prompt, so a
    # batch's prompts do not fit one step together
    engine = LLM(
        **engine_kwargs(
            str(tiny_llama),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            enable_prefix_caching=False,
            per_request_seeds=True,
            max_num_batched_tokens=MAX_MODEL_LEN,
        )
    )
    yield engine
    shutdown_engine(engine)


def _cfg(tiny_llama, data_file, out, **kw) -> RegenerateConfig:
    values = dict(
        target=str(tiny_llama),
        data=str(data_file),
        out=out,
        max_new_tokens=MAX_NEW,
        max_model_len=MAX_MODEL_LEN,
        batch_size=4,
    )
    return RegenerateConfig(**{**values, **kw})


def test_generation_points():
    u, a, s = ({"role": r, "content": "x"} for r in ("user", "assistant", "system"))
    assert generation_points([s, u, a, u, a]) == [2, 4]
    assert generation_points([u]) == [1]
    assert generation_points([u, a, u]) == [1, 3]


def test_regenerate_full(tiny_llama, data_file, llm, tmp_path):
    res = run_regenerate(_cfg(tiny_llama, data_file, tmp_path / "full"), llm=llm)
    assert isinstance(res, RegenerateResult)
    assert res.num_rows == 11
    assert res.skipped.get("prompt_too_long") == 1
    written = read_conversations(res.conversations_path)  # prepare's reader accepts it
    assert len(written.conversations) == res.num_written and not written.skipped
    assert (
        res.num_written
        + sum(v for k, v in res.skipped.items() if k in ("prompt_too_long", "empty_answer"))
        == 11
    )
    src = {
        c.sample_id: c for c in read_conversations(data_file, require_assistant=False).conversations
    }
    multi = 0
    for c in written.conversations:
        orig = src[c.sample_id].messages
        # the same non-assistant turns in the same order; the assistant turns are the target's
        n = len(c.messages)
        if c.sample_id == "prompt-only":
            assert [m["role"] for m in c.messages] == ["user", "assistant"]
        else:
            assert [m["role"] for m in c.messages] == [m["role"] for m in orig[:n]]
        for m, o in zip(c.messages, orig, strict=False):
            if m["role"] != "assistant":
                assert m == o
        multi += sum(m["role"] == "assistant" for m in c.messages) > 1
    assert multi >= 2
    m = json.loads((tmp_path / "full" / "manifest.json").read_text())
    assert sum(m["finish_reasons"].values()) >= res.num_turns > res.num_written
    assert set(m["finish_reasons"]) <= {"stop", "length"}
    assert m["counts"]["regenerated_turns"] == res.num_turns
    assert m["config"]["batch_size"] == 4 and m["engine"]["dtype"] in ("float32", "bfloat16")
    assert (
        not (tmp_path / "full" / PARTIAL).exists() and not (tmp_path / "full" / PROGRESS).exists()
    )
    # a rerun of a finished output is a no-op; other settings are refused
    again = run_regenerate(_cfg(tiny_llama, data_file, tmp_path / "full"), llm=llm)
    assert again.num_written == res.num_written
    with pytest.raises(ValueError, match="other settings"):
        run_regenerate(_cfg(tiny_llama, data_file, tmp_path / "full", max_new_tokens=8), llm=llm)
    pytest.full_output = res.conversations_path.read_bytes()  # for the resume test


def test_sampled_turns_are_seeded_per_row_and_prompts_beyond_one_step_survive(
    tiny_llama, data_file, llm, tmp_path
):
    """Sampled regeneration seeds each row's turns, so a rerun writes the same conversations. The
    batch's prompts need more than one engine step: on the CPU a seeded request whose prompt was
    split over two steps used to kill the engine ("CPU Generator does not use offset"), so the
    stage's engines take prompts whole there (per_request_seeds)."""
    from eagle3.vllm_engine import on_cpu_platform

    if on_cpu_platform():
        assert llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill is False
    runs = [
        run_regenerate(
            _cfg(tiny_llama, data_file, tmp_path / f"t{i}", temperature=0.8, batch_size=11),
            llm=llm,
        )
        for i in range(2)
    ]
    assert runs[0].num_written == runs[1].num_written > 0
    assert runs[0].conversations_path.read_bytes() == runs[1].conversations_path.read_bytes()


def test_regenerated_turns_train_exactly_as_generated(tiny_llama, data_file, llm, tmp_path):
    """Each regenerated turn keeps the ids the target generated and the prompt ids the engine saw
    (vLLM includes the end-of-turn token it stopped on), and prepare trains on exactly those
    ids: the supervised ids of a conversation are its turns' generated ids, in order."""
    from eagle3.config import PrepareConfig
    from eagle3.data.prepare import run_prepare
    from eagle3.data.regenerate import open_renderer
    from eagle3.prepared import supervised_ids_by_conversation

    cfg = _cfg(tiny_llama, data_file, tmp_path / "regen")
    res = run_regenerate(cfg, llm=llm)
    renderer = open_renderer(cfg)
    eos = renderer.end_of_turn_id
    generated: dict[str, list[int]] = {}
    for c in read_conversations(res.conversations_path).conversations:
        ids: list[int] = []
        for i, m in enumerate(c.messages):
            if m["role"] != "assistant":
                continue
            assert m["prompt_token_ids"] == renderer.prompt_ids(c.messages[:i])
            assert (m["token_ids"][-1] == eos) == (m["finish_reason"] == "stop")
            text = renderer.tokenizer.decode(m["token_ids"], skip_special_tokens=True)
            assert text == m["content"]
            ids += m["token_ids"]
        generated[c.sample_id] = ids
    prep = run_prepare(
        PrepareConfig(target=str(tiny_llama), data=str(res.conversations_path), out=tmp_path / "p")
    )
    assert prep.turns["from_generated"] == res.num_turns and not prep.turns.get("from_text")
    # a turn whose prompt does not extend the row before it (the target's ids are not how the
    # template re-tokenizes its text) starts a row of its own, named after its conversation
    trained = supervised_ids_by_conversation(tmp_path / "p")
    assert trained == generated


class _Killed(Exception):
    pass


def test_regenerate_resume_after_kill(tiny_llama, data_file, llm, tmp_path):
    out = tmp_path / "resumed"
    cfg = _cfg(tiny_llama, data_file, out)

    def kill_after_first(batch_index: int, rows_done: int) -> None:
        if batch_index == 0:
            raise _Killed

    with pytest.raises(_Killed):
        run_regenerate(cfg, llm=llm, on_batch=kill_after_first)
    assert not (out / "conversations.jsonl").exists()  # no half-written final file
    prog = json.loads((out / PROGRESS).read_text())
    assert prog["rows_done"] == 4
    first_batch_lines = (out / PARTIAL).read_bytes().count(b"\n")
    # a crash in the middle of appending the next batch leaves a torn line behind
    with open(out / PARTIAL, "ab") as f:
        f.write(b'{"id": "torn", "messages": [')
    res = run_regenerate(cfg, llm=llm)
    assert res.resumed_from_row == 4
    text = res.conversations_path.read_bytes()
    ids = [json.loads(line)["id"] for line in text.splitlines()]
    assert len(ids) == len(set(ids)) == res.num_written and "torn" not in ids
    assert first_batch_lines <= res.num_written
    full = getattr(pytest, "full_output", None)
    if full is None:
        full_res = run_regenerate(_cfg(tiny_llama, data_file, tmp_path / "full2"), llm=llm)
        full = full_res.conversations_path.read_bytes()
    assert text == full  # greedy: identical to the uninterrupted run


def test_missing_target_flag(data_file, tmp_path):
    from eagle3.config import ConfigError

    with pytest.raises(ConfigError, match="--target"):
        run_regenerate(RegenerateConfig(data=str(data_file), out=tmp_path))


def test_regenerate_hf_backend_matches_vllm_greedy(tiny_llama, data_file, llm, tmp_path):
    """backend=hf (hosts without vLLM): same output format, and greedy tokens that agree with vLLM's
    wherever the target is not at a tie. The tiny target is random, so its logits are nearly flat
    and the two float32 implementations' rounding can flip an argmax at a near-tie. The check is
    therefore per token: where the two answers first differ, the target must rate both tokens within
    TIE_LOGIT of each other. A broken backend (wrong prompt, sampling, bad stop handling) parts at a
    clear winner."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle3.data.regenerate import _HfBackendGenerator, _VllmGenerator, open_renderer

    res = run_regenerate(
        _cfg(tiny_llama, data_file, tmp_path / "hf", backend="hf", device="cpu", dtype="float32")
    )
    written = read_conversations(res.conversations_path)
    assert len(written.conversations) == res.num_written and not written.skipped
    assert json.loads((tmp_path / "hf" / "manifest.json").read_text())["engine"]["backend"] == "hf"

    cfg = _cfg(
        tiny_llama, data_file, tmp_path / "tokens", backend="hf", device="cpu", dtype="float32"
    )
    tok = open_renderer(cfg)
    prompts = [tok.prompt_ids(c.messages[:1]) for c in read_conversations(data_file).conversations]
    prompts = [p for p in prompts if len(p) <= MAX_MODEL_LEN - MAX_NEW]
    ref = _VllmGenerator(llm, cfg).generate(prompts, [None] * len(prompts))
    ours = _HfBackendGenerator(cfg, tok).generate(prompts, [None] * len(prompts))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()
    # float32 kernels differ by ~1e-5 on these logits (~3.0); half precision missed by 1-3e-2
    TIE_LOGIT = 1e-3
    num_same = 0
    for prompt, (a, _, _), (b, _, _) in zip(prompts, ref, ours, strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if k is None:
            assert len(a) == len(b), f"one answer stops early: {a} vs {b}"
            num_same += 1
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + a[:k]])).logits[0, -1]  # (V,)
        gap = abs(float(logits[a[k]] - logits[b[k]]))
        assert gap < TIE_LOGIT, (
            f"token {k}: vLLM {a[k]} vs hf {b[k]}, logit gap {gap:.2e} is no tie"
        )
    assert num_same >= 1, "no answer agreed in full"
