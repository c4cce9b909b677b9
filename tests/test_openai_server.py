"""Generation through a real `vllm serve` process (eagle3.data.openai_server): token ids and prompt
ids from the server, seeds, retries while the server comes up, clear 4xx errors, the reasoning
parser's split, and a server that leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from eagle3.data.openai_server import (
    GeneratedTurn,
    OpenAIChatGenerator,
    ServerRequestError,
    ServerStartError,
    VllmServer,
    free_port,
    process_group_members,
    start_vllm_server,
)
from eagle3.processes import descendants, is_running, name

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_MODEL_LEN = 512
MAX_TOKENS = 48

QUESTIONS = [
    "What is the name of the sea below the house?",
    "Tell me a story about a boy and his animal.",
    "Write the list of numbers from one to five.",
]


def template_ids(tok, messages, **kwargs) -> list[int]:
    return list(
        tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kwargs)
    )


def users(*texts: str) -> list[list[dict]]:
    return [[{"role": "user", "content": t}] for t in texts]


@dataclass
class Served:
    server: VllmServer
    early: dict = field(default_factory=dict)  # what requests sent before the server ran got
    early_generator: OpenAIChatGenerator | None = None


@pytest.fixture(scope="module")
def served(tiny_chatml, tmp_path_factory):
    """A `vllm serve` of the tiny ChatML word emitter for the module. Two requests are sent to its
    port before the server starts: they are refused until it listens, and retried until it
    answers."""
    port = free_port()
    early_generator = OpenAIChatGenerator(
        f"http://127.0.0.1:{port}",
        "chatml",
        num_concurrent=2,
        max_retries=10_000,
        retry_deadline_s=900,
        retry_initial_s=0.2,
        retry_max_s=2.0,
        request_timeout_s=900,
    )
    early: dict = {}

    def send_early() -> None:
        try:
            early["turns"] = early_generator.generate(
                users(*QUESTIONS[:2]), [1, 2], temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS
            )
        except Exception as e:  # the test reports it
            early["error"] = e

    sender = threading.Thread(target=send_early, daemon=True)
    sender.start()
    log_path = tmp_path_factory.mktemp("server") / "vllm_server.log"
    with start_vllm_server(
        tiny_chatml, log_path=log_path, port=port, max_model_len=MAX_MODEL_LEN
    ) as server:
        print(f"vLLM server start-up: {server.startup_s:.1f} s")
        sender.join(timeout=300)
        yield Served(server, early, early_generator)


def test_requests_sent_before_the_server_listens_are_retried_until_it_answers(served):
    assert "error" not in served.early, served.early.get("error")
    turns = served.early["turns"]
    assert len(turns) == 2 and all(t.token_ids for t in turns)
    counts = served.early_generator.counts
    assert counts.retries_by_reason["connection"] > 0, counts.to_json()
    assert not counts.failures_by_reason and counts.num_completed == 2


def test_token_ids_and_prompt_ids_come_from_the_server(served, tiny_chatml):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_chatml))
    gen = served.server.generator(num_concurrent=3)
    seen: list[GeneratedTurn] = []
    first = gen.generate(users(*QUESTIONS), [0, 1, 2], 1.0, 1.0, MAX_TOKENS, progress=seen.append)
    assert len(seen) == 3 and sorted(id(t) for t in seen) == sorted(id(t) for t in first)
    # the second turn: the first answer in the history
    two_turn = [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": first[0].content, "token_ids": first[0].token_ids},
        {"role": "user", "content": "And then what happened?"},
    ]
    (second,) = gen.generate([two_turn], [3], 1.0, 1.0, MAX_TOKENS)
    convs = [*users(*QUESTIONS), two_turn]
    for messages, turn in zip(convs, [*first, second], strict=True):
        wire = [{"role": m["role"], "content": m["content"]} for m in messages]
        assert turn.prompt_token_ids == template_ids(tok, wire)
        assert turn.token_ids, turn
        assert tok.decode(turn.token_ids, skip_special_tokens=True) == turn.content
        assert turn.reasoning is None  # no reasoning parser on this server
        if turn.finish_reason == "stop":  # the end-of-turn token is among the generated ids
            assert turn.token_ids[-1] == tok.eos_token_id
        else:
            assert turn.finish_reason == "length" and len(turn.token_ids) == MAX_TOKENS
    assert any(t.finish_reason == "stop" for t in [*first, second])
    # the history's answer is rendered into the prompt of the second turn
    answer = f"<|im_start|>assistant\n{first[0].content}<|im_end|>"
    assert answer in tok.decode(second.prompt_token_ids)
    c = gen.counts
    assert c.num_completed == 4 and c.num_requests == 4 and c.num_retries == 0
    assert c.num_completion_tokens == sum(len(t.token_ids) for t in [*first, second])
    assert c.num_prompt_tokens == sum(len(t.prompt_token_ids) for t in [*first, second])


def test_a_seed_repeats_the_sampled_answer(served):
    gen = served.server.generator(num_concurrent=4)
    convs = users(*QUESTIONS, QUESTIONS[0])
    a = gen.generate(convs, [7, 8, 9, 10], 1.0, 1.0, MAX_TOKENS)
    b = gen.generate(convs, [7, 8, 9, 10], 1.0, 1.0, MAX_TOKENS)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    # the same prompt with another seed: another sample
    assert a[0].token_ids != a[3].token_ids


def test_an_unknown_model_is_a_clear_error_and_not_retried(served):
    gen = OpenAIChatGenerator(served.server.base_url, "no-such-model", retry_initial_s=0.01)
    with pytest.raises(ServerRequestError) as info:
        gen.generate(users("Where is the house of my mother?"), [None], 0.0, 1.0, 8)
    msg = str(info.value)
    assert "HTTP 404" in msg and "no-such-model" in msg, msg
    assert "Where is the house of my mother?" in msg, msg
    assert gen.counts.num_retries == 0 and gen.counts.failures_by_reason == {"http 404": 1}


def test_the_served_model_is_found_and_a_server_without_ids_gives_none(served):
    gen = OpenAIChatGenerator(
        served.server.base_url + "/",  # the API root as a user may write it
        model=None,
        extra_request_fields={"return_token_ids": False},
    )
    assert gen.model == served.server.model == "chatml"
    (turn,) = gen.generate(users(QUESTIONS[1]), [4], 1.0, 1.0, MAX_TOKENS)
    assert turn.token_ids is None and turn.prompt_token_ids is None
    assert turn.finish_reason in ("stop", "length")
    assert gen.counts.num_without_token_ids == 1 and gen.counts.num_completion_tokens > 0


def test_a_request_out_of_time_is_retried_then_fails_naming_the_timeout(served):
    # 400 tokens (the end of the turn ignored) take the idle server a few tenths of a second, and a
    # socket timeout is per wait: a client thread the host delays for longer than that finds the
    # answer ready (seen in the full suite on 2 busy cores). 64 long requests sent first keep the
    # server decoding for ~2 s, so the timed ones, decoded among them, cannot answer in 0.05 s.
    busy = served.server.generator(
        num_concurrent=64, extra_request_fields={"ignore_eos": True}, request_timeout_s=600
    )
    burst = threading.Thread(
        target=busy.generate,
        args=(users(*[QUESTIONS[1]] * 64), list(range(64)), 1.0, 1.0, MAX_MODEL_LEN - 112),
        daemon=True,
    )
    burst.start()
    gen = served.server.generator(
        request_timeout_s=0.05,
        max_retries=2,
        retry_initial_s=0.01,
        num_concurrent=1,
        extra_request_fields={"ignore_eos": True},
    )
    with pytest.raises(ServerRequestError) as info:
        gen.generate(users(QUESTIONS[2]), [0], 1.0, 1.0, MAX_MODEL_LEN - 112)
    msg = str(info.value)
    assert "failed 3 times" in msg and "no answer within 0.05 s" in msg, msg
    assert gen.counts.retries_by_reason == {"timeout": 2}
    assert gen.counts.failures_by_reason == {"timeout": 1}
    burst.join(timeout=300)  # the server free again for the next test
    assert not burst.is_alive()


def test_a_server_that_fails_to_start_shows_its_log_and_leaves_nothing(tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    (not_a_model / "config.json").write_text('{"model_type": "no_such_architecture"}')
    log_path = tmp_path / "server.log"
    before = set(descendants())
    t0 = time.monotonic()
    with pytest.raises(ServerStartError) as info:
        with start_vllm_server(not_a_model, log_path=log_path, startup_timeout_s=300):
            pass
    msg = str(info.value)
    assert "exited with code" in msg and str(log_path) in msg, msg
    assert "no_such_architecture" in msg, msg  # vLLM's own diagnosis, from the log's tail
    assert time.monotonic() - t0 < 300
    assert set(descendants()) <= before


# ------------------------------------------------------------------------ a reasoning parser
#: ChatML with a thinking block, as the Qwen3 / DeepSeek-R1-distill templates: the generation prompt
#: opens `<think>` (or, with enable_thinking false, holds an empty block), and an assistant turn of
#: the history renders its `reasoning_content` inside one
THINK_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% if m.get('reasoning_content') %}"
    "{{ '<think>\n' + m['reasoning_content'] + '</think>\n' }}{% endif %}"
    "{{ m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}"
    "{{ '<think>\n\n</think>\n\n' }}{% else %}{{ '<think>\n' }}{% endif %}{% endif %}"
)


def build_thinking_target(out: Path) -> Path:
    """The tiny ChatML word emitter with `<think>` / `</think>` as tokens of their own (added, not
    special: decoding keeps them, as Qwen3's and DeepSeek-R1's tokenizers do), THINK_TEMPLATE, and
    `</think>` as likely per step as the end of the turn."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3.testing.tiny import TinySpec, build_tiny_target, make_word_emitter

    build_tiny_target(out, TinySpec(arch="llama", num_layers=2, chatml=True, seed=3))
    tok = AutoTokenizer.from_pretrained(str(out))
    tok.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")]
    )
    tok.chat_template = THINK_TEMPLATE
    tok.save_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    model.resize_token_embeddings(len(tok))
    model.save_pretrained(str(out))
    make_word_emitter(out)
    weights = load_file(str(out / "model.safetensors"))
    head = weights["lm_head.weight"]
    head[tok.convert_tokens_to_ids("</think>"), 0] = head[tok.eos_token_id, 0]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


#: starts `vllm serve` under start_vllm_server in a process of its own, writes what a client needs
#: to a file once the server is healthy, and sleeps until it is killed
RUN_A_SERVER = """
import json, sys, time
from pathlib import Path
from eagle3.data.openai_server import start_vllm_server
target, log_path, max_model_len, reasoning_parser, ready = sys.argv[1:]
with start_vllm_server(
    target,
    log_path=log_path,
    max_model_len=int(max_model_len),
    reasoning_parser=reasoning_parser,
) as server:
    info = dict(pid=server.pid, base_url=server.base_url, model=server.model)
    Path(ready).write_text(json.dumps(dict(info, startup_s=server.startup_s)))
    time.sleep(600)
"""


def test_the_reasoning_parser_splits_the_trace_and_thinking_can_be_switched_off(tmp_path):
    """A server with vLLM's reasoning parser, started (start_vllm_server) by a process of its own:
    the trace and the answer come back split, thinking can be switched off, a history turn's
    reasoning reaches the template; then the starting process is SIGKILLed and the server, its
    engine and its worker die with it."""
    import json

    from transformers import AutoTokenizer

    target = build_thinking_target(tmp_path / "thinking")
    tok = AutoTokenizer.from_pretrained(str(target))
    think_end = tok.convert_tokens_to_ids("</think>")
    questions = [f"Question number {i}: {q}" for i in range(4) for q in QUESTIONS]
    ready = tmp_path / "ready.json"
    args = [str(target), str(tmp_path / "server.log"), str(MAX_MODEL_LEN), "qwen3", str(ready)]
    starter = subprocess.Popen([sys.executable, "-c", RUN_A_SERVER, *args])
    try:
        deadline = time.monotonic() + 600
        while not ready.exists():
            assert starter.poll() is None, f"the starter exited with code {starter.returncode}"
            assert time.monotonic() < deadline, "the server did not start within 600 s"
            time.sleep(0.5)
        server = json.loads(ready.read_text())
        print(f"vLLM server start-up (reasoning parser): {server['startup_s']:.1f} s")
        group = [server["pid"], *descendants(server["pid"])]
        assert len(group) >= 3 and process_group_members(server["pid"])  # server, engine, worker
        names = [name(pid) for pid in descendants(starter.pid)]
        assert any("EngineCore" in n for n in names) and any("Worker" in n for n in names), names
        gen = OpenAIChatGenerator(server["base_url"], server["model"], num_concurrent=4)
        seeds = list(range(len(questions)))
        thinking = gen.generate(users(*questions), seeds, 1.0, 1.0, MAX_TOKENS)
        kinds = set()
        for messages, turn in zip(users(*questions), thinking, strict=True):
            assert turn.prompt_token_ids == template_ids(tok, messages)
            ids = turn.token_ids
            if think_end in ids:  # the trace ends at the first </think>
                end = ids.index(think_end)
                # an empty trace (</think> first) comes back as no reasoning at all
                assert (turn.reasoning or "") == tok.decode(ids[:end], skip_special_tokens=True)
                if ids.count(think_end) == 1:
                    kinds.add("split")
                    assert turn.content == tok.decode(ids[end + 1 :], skip_special_tokens=True)
            else:  # the turn ended inside its trace: all of it is reasoning
                kinds.add("trace only")
                assert turn.reasoning == tok.decode(ids, skip_special_tokens=True)
                assert turn.content == ""
        assert kinds == {"split", "trace only"}, [t.token_ids for t in thinking]

        # thinking off (Qwen3's switch): the template closes the block, the parser splits nothing
        off = {"enable_thinking": False}
        answers = gen.generate(users(*questions[:3]), seeds[:3], 1.0, 1.0, MAX_TOKENS, off)
        for messages, turn in zip(users(*questions[:3]), answers, strict=True):
            assert turn.prompt_token_ids == template_ids(tok, messages, enable_thinking=False)
            assert turn.reasoning is None
            assert turn.content == tok.decode(turn.token_ids, skip_special_tokens=True)

        # a history turn's reasoning reaches the template
        history = [
            {"role": "user", "content": questions[0]},
            {"role": "assistant", "content": "the sea", "reasoning": "I thought about water"},
            {"role": "user", "content": "Why?"},
        ]
        (turn,) = gen.generate([history], [0], 1.0, 1.0, MAX_TOKENS)
        rendered = [
            history[0],
            {
                "role": "assistant",
                "content": "the sea",
                "reasoning_content": "I thought about water",
            },
            history[2],
        ]
        assert turn.prompt_token_ids == template_ids(tok, rendered)
        assert "<think>\nI thought about water</think>" in tok.decode(turn.prompt_token_ids)
    finally:
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
    # the server and every process it started die with the process that started it
    deadline = time.monotonic() + 30
    while [pid for pid in group if is_running(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [name(pid) for pid in group if is_running(pid)]
    assert not process_group_members(server["pid"])


# ------------------------------------------------------------------------------- regenerate stage
TWO_TURNS = [
    {
        "id": f"chat-{i}",
        "messages": [
            {"role": "user", "content": q},
            {"role": "assistant", "content": "old answer"},
            {"role": "user", "content": "And then what happened?"},
        ],
    }
    for i, q in enumerate(QUESTIONS)
]


def _regenerate_config(target, tmp_path, **kw):
    import json

    from eagle3.config import RegenerateConfig

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TWO_TURNS))
    values = dict(
        target=str(target),
        data=str(data),
        out=tmp_path / "regen",
        backend="server",
        max_new_tokens=MAX_TOKENS,
        max_model_len=MAX_MODEL_LEN,
        temperature=0.0,
        batch_size=2,
        num_concurrent=3,
    )
    return RegenerateConfig(**{**values, **kw})


def _check_trained_as_served(cfg, res, tmp_path) -> None:
    """Every regenerated turn holds the server's ids, its prompt ids equal this template's, and
    prepare supervises exactly those ids."""
    from eagle3.chat_formats import read_conversations
    from eagle3.config import PrepareConfig
    from eagle3.data.prepare import run_prepare
    from eagle3.data.regenerate import open_renderer
    from eagle3.prepared import load_prepared

    renderer = open_renderer(cfg)
    generated: dict[str, list[int]] = {}
    for c in read_conversations(res.conversations_path).conversations:
        turns = [(i, m) for i, m in enumerate(c.messages) if m["role"] == "assistant"]
        assert len(turns) == 2  # the second answer is written after the first, regenerated one
        for i, m in turns:
            assert m["prompt_token_ids"] == renderer.prompt_ids(c.messages[:i])
            decoded = renderer.tokenizer.decode(m["token_ids"], skip_special_tokens=True)
            assert decoded == m["content"]
            generated.setdefault(c.sample_id, []).extend(m["token_ids"])
    prep = run_prepare(
        PrepareConfig(target=cfg.target, data=str(res.conversations_path), out=tmp_path / "p")
    )
    assert prep.turns["from_generated"] == 2 * len(TWO_TURNS)
    trained: dict[str, list[int]] = {}
    ds = load_prepared(tmp_path / "p")
    for sid, ids, mask in zip(ds["sample_id"], ds["input_ids"], ds["loss_mask"], strict=True):
        kept = [int(t) for t, k in zip(ids, mask, strict=True) if k]
        trained.setdefault(str(sid).split(":row")[0], []).extend(kept)
    assert trained == generated


def test_regenerate_through_a_running_server_keeps_its_ids(served, tiny_chatml, tmp_path):
    """`backend: server` with the URL of a running server (the user's own deployment): the
    stage sends the conversations, keeps the ids the server returns, and prepare trains on
    exactly them."""
    from eagle3.data.regenerate import run_regenerate

    cfg = _regenerate_config(
        tiny_chatml,
        tmp_path,
        server_url=served.server.base_url,
        served_model_name=served.server.model,
    )
    res = run_regenerate(cfg)
    assert res.num_written == len(TWO_TURNS) and res.num_turns == 2 * len(TWO_TURNS)
    engine = res.manifest["engine"]
    assert engine["backend"] == "server" and engine["started"] is False
    assert engine["requests"]["num_completed"] == 2 * len(TWO_TURNS)
    assert not res.manifest["counts"].get("turns_without_ids")
    _check_trained_as_served(cfg, res, tmp_path)


def test_regenerate_starts_and_stops_its_own_server(tiny_chatml, tmp_path):
    """`backend: server` without a URL: the stage starts vLLM's server for the target, generates
    through it, and leaves no process behind."""
    from eagle3.data.regenerate import SERVER_LOG, run_regenerate
    from eagle3.processes import descendants

    before = set(descendants())
    cfg = _regenerate_config(tiny_chatml, tmp_path)
    res = run_regenerate(cfg)
    assert res.manifest["engine"]["started"] is True and res.manifest["engine"]["startup_s"] > 0
    assert (tmp_path / "regen" / SERVER_LOG).is_file()
    left = [pid for pid in set(descendants()) - before if is_running(pid)]
    assert not left, f"processes left: {[name(p) for p in left]}"
    _check_trained_as_served(cfg, res, tmp_path)
