"""`eagle3 regenerate`: replace every assistant turn of the chat data with the target's own answer.

EAGLE-3 drafts learn the *target's* distribution, so the training answers should be what the target
itself says. For each conversation, every assistant turn is regenerated from the turns before it
(the regenerated history, not the dataset's answers), turn by turn: in a batch of `batch_size`
conversations all first answers are generated in one call, then all second answers, and so on. A
row whose last turn is a user turn (prompt-only rows such as `{"question": ...}`) gets an answer
appended.

Backends: `vllm` (an offline engine), `hf` (transformers), and `server`: an OpenAI-compatible chat
server, the user's own deployment at `server_url`, or vLLM's server for the target that the stage
starts (with the family's `reasoning_parser`) and stops, `num_concurrent` requests in flight with
retries (eagle3.data.openai_server). The offline backends are given prompts rendered by the
target's chat template with the run's or the row's `chat_template_kwargs` (eagle3.chat_template);
a server renders them itself from the messages. Greedy unless `temperature > 0` (then each turn
has its own seed derived from `seed`, the row index and the turn, so a resumed run samples the
same).

Token-exact turns. Each regenerated assistant turn keeps the ids the target generated
(`token_ids`, the end-of-turn token included when it stopped on it), the prompt ids it was given
(`prompt_token_ids`: a server's own where it returns them), `finish_reason`, and its text split at
`</think>` into `reasoning` and `content`. Prepare trains on those ids. A server that returns no
ids leaves text only, which prepare checks against the template (`turns_without_ids` counted).

Edge cases (all counted in manifest.json):
* a prompt longer than `max_model_len - max_new_tokens` tokens: the conversation ends before that
  turn; if it is the first turn the conversation is dropped (`prompt_too_long`), else it is kept
  with the turns done so far (`truncated_too_long`);
* an empty answer (the target stopped at once) ends the conversation the same way (`empty_answer`,
  `truncated_empty_answer`), since an empty assistant turn is not a training sample;
* an answer that hits `max_new_tokens` (a cut reasoning trace) is kept as it is, finish reason
  `length`: it is exactly what the target says for that many tokens. The share of such turns per
  source is `truncated_share`; `drop_truncated` ends the conversation before such a turn instead.

Output (in `out`): `conversations.jsonl` (rows `{"id", "messages": [...], "category"?,
"chat_template_kwargs"?, "source"?}` that `eagle3 prepare` reads) and `manifest.json`. Resume:
while running, batches are appended (fsync) to `conversations.partial.jsonl` and `progress.json`
records the rows consumed and the byte size after the last complete batch; a rerun with the same
generation settings truncates the partial file to that size and continues with the next batch, so
nothing is duplicated or lost. At the end the partial file is renamed to `conversations.jsonl` (a
reader never sees a half-written file under that name).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.chat_formats import Conversation, check_skipped, read_conversations
from eagle3.chat_template import ChatRenderer
from eagle3.config import RegenerateConfig
from eagle3.data.generate_hf import HfGenerator
from eagle3.data.openai_server import GeneratedTurn, start_vllm_server
from eagle3.identity import describe_difference, target_fingerprint
from eagle3.io import read_json, sha256_file, sha256_json, write_json
from eagle3.lock import dir_lock, record_engine_processes
from eagle3.vllm_engine import engine_kwargs, setup_cpu_env, shutdown_engine

log = logging.getLogger(__name__)

OUTPUT = "conversations.jsonl"
#: the log of the vLLM server the stage starts (backend server without server_url)
SERVER_LOG = "server.log"
PARTIAL = "conversations.partial.jsonl"
PROGRESS = "progress.json"
MANIFEST = "manifest.json"

#: RegenerateConfig fields that change the generated text; a resume requires them unchanged.
_FINGERPRINT_FIELDS = (
    "target",
    "data",
    "max_new_tokens",
    "temperature",
    "top_p",
    "batch_size",
    "max_model_len",
    "seed",
    "dtype",
    "backend",
    "chat_template_kwargs",
    "trust_remote_code",
    "drop_truncated",
    "server_url",
    "served_model_name",
    "reasoning_parser",
)


@dataclass
class RegenerateResult:
    out: Path
    conversations_path: Path
    num_rows: int
    num_written: int
    num_turns: int
    generated_tokens: int
    finish_reasons: dict[str, int]
    skipped: dict[str, int]
    resumed_from_row: int = 0
    elapsed_s: float = 0.0
    manifest: dict[str, Any] = field(default_factory=dict)
    #: generated ids inside think blocks (thinking targets)
    reasoning_tokens: int = 0
    #: per source: the share of generated turns that hit max_new_tokens
    truncated_share: dict[str, float] = field(default_factory=dict)


def _fingerprint(cfg: RegenerateConfig) -> str:
    d = cfg.model_dump(mode="json")
    fp = {k: d.get(k) for k in _FINGERPRINT_FIELDS}
    data = Path(str(cfg.data))
    if data.is_file():  # the same path with other content must not resume
        fp["data_sha256"] = sha256_file(data)
    return sha256_json(fp)


def generation_points(messages: list[dict[str, str]]) -> list[int]:
    """Indices of the assistant turns to regenerate; len(messages) when the last turn needs an
    answer."""
    points = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages and messages[-1]["role"] != "assistant":
        points.append(len(messages))
    return points


@dataclass
class _Stats:
    turns: int = 0
    generated_tokens: int = 0
    finish: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    #: reasoning figures: turns_with_reasoning, reasoning_tokens, answer_tokens
    reasoning: Counter = field(default_factory=Counter)
    #: source (the row's `source`, else the data file) -> {"turns": n, "hit_max_new_tokens": n}
    by_source: dict[str, Counter] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "turns": self.turns,
            "generated_tokens": self.generated_tokens,
            "finish": dict(self.finish),
            "dropped": dict(self.dropped),
            "reasoning": dict(self.reasoning),
            "by_source": {k: dict(v) for k, v in self.by_source.items()},
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Stats:
        return cls(
            d["turns"],
            d["generated_tokens"],
            Counter(d["finish"]),
            Counter(d["dropped"]),
            Counter(d.get("reasoning", {})),
            {k: Counter(v) for k, v in d.get("by_source", {}).items()},
        )

    def truncated_share(self) -> dict[str, float]:
        """Per source: the share of generated turns that hit max_new_tokens (cut traces)."""
        return {
            src: round(c["hit_max_new_tokens"] / c["generated"], 4)
            for src, c in self.by_source.items()
            if c["generated"]
        }


class _VllmGenerator:
    """vLLM offline generation behind the same call as HfGenerator.generate."""

    def __init__(self, llm: Any, cfg: RegenerateConfig, owned: bool = False):
        self.llm, self.cfg, self.owned = llm, cfg, owned

    def generate(
        self, prompts: list[list[int]], seeds: list[int | None], temperature: float | None = None
    ) -> list[tuple[list[int], str, str]]:
        """(token ids, text, finish reason) per prompt; `temperature` overrides the config's
        for this call."""
        from vllm import SamplingParams

        cfg = self.cfg
        temp = cfg.temperature if temperature is None else temperature
        params = [
            SamplingParams(
                temperature=temp,
                top_p=cfg.top_p if temp > 0 else 1.0,
                max_tokens=cfg.max_new_tokens,
                seed=seed,
            )
            for seed in seeds
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        return [
            (
                list(o.outputs[0].token_ids),
                o.outputs[0].text,
                o.outputs[0].finish_reason or "unknown",
            )
            for o in outputs
        ]

    def close(self) -> None:
        """Shut the engine down when this generator started it (its memory is then free for
        the next engine)."""
        if self.owned and self.llm is not None:
            shutdown_engine(self.llm)
        self.llm = None


class _HfBackendGenerator:
    """transformers generation (hosts without vLLM); text decoded as vLLM does (special tokens
    skipped)."""

    def __init__(self, cfg: RegenerateConfig, tok: ChatRenderer):
        self.cfg, self.tok = cfg, tok
        self.gen = HfGenerator(
            str(cfg.target),
            device=cfg.device,
            dtype=cfg.dtype,
            batch_size=cfg.batch_size,
            trust_remote_code=cfg.trust_remote_code,
        )

    def generate(
        self, prompts: list[list[int]], seeds: list[int | None], temperature: float | None = None
    ) -> list[tuple[list[int], str, str]]:
        """As _VllmGenerator.generate; one seed per call (the first given, else cfg.seed) seeds
        the whole batch."""
        cfg = self.cfg
        temp = cfg.temperature if temperature is None else temperature
        seed = next((x for x in seeds if x is not None), cfg.seed)
        outs = self.gen.generate(prompts, cfg.max_new_tokens, temp, cfg.top_p, seed=seed)
        return [
            (
                g.token_ids,
                self.tok.tokenizer.decode(g.token_ids, skip_special_tokens=True),
                g.finish_reason,
            )
            for g in outs
        ]

    def close(self) -> None:
        """Drop the model (and its GPU memory)."""
        self.gen.close()


class _ServerGenerator:
    """An OpenAI-compatible chat server (eagle3.data.openai_server) behind `generate_turns`: it is
    sent the conversation's messages, and renders and generates itself; its ids are kept where it
    returns them."""

    chat = True

    def __init__(
        self,
        cfg: RegenerateConfig,
        base_url: str,
        model: str | None,
        owned: contextlib.ExitStack | None = None,
    ):
        from eagle3.data.openai_server import OpenAIChatGenerator

        self.cfg, self.owned = cfg, owned
        self.client = OpenAIChatGenerator(
            base_url,
            model,
            api_key_env=cfg.api_key_env,
            num_concurrent=cfg.num_concurrent,
            request_timeout_s=cfg.request_timeout_s,
        )

    def generate_turns(
        self,
        contexts: list[list[dict[str, Any]]],
        seeds: list[int | None],
        kwargs: list[dict[str, Any]],
    ) -> list[GeneratedTurn]:
        """One GeneratedTurn per context, in order; contexts are sent in groups of equal
        chat_template_kwargs (a mix of sources)."""
        cfg, out = self.cfg, [None] * len(contexts)
        groups: dict[str, list[int]] = {}
        for i, kw in enumerate(kwargs):
            groups.setdefault(json.dumps(kw, sort_keys=True), []).append(i)
        for key, idx in groups.items():
            turns = self.client.generate(
                [contexts[i] for i in idx],
                [seeds[i] for i in idx],
                cfg.temperature,
                cfg.top_p,
                cfg.max_new_tokens,
                json.loads(key) or None,
            )
            for i, t in zip(idx, turns, strict=True):
                out[i] = t
        return out

    def close(self) -> None:
        """Stop the server this generator started (a server given by URL is left running)."""
        if self.owned is not None:
            self.owned.close()
            self.owned = None


def open_renderer(cfg: Any) -> ChatRenderer:
    """The target's chat template with the config's kwargs and trust_remote_code."""
    return ChatRenderer(
        cfg.target,
        trust_remote_code=cfg.trust_remote_code,
        chat_template_kwargs=cfg.chat_template_kwargs,
        stage=cfg.stage or "regenerate",
    )


def open_generator(
    cfg: RegenerateConfig, tok: ChatRenderer, llm: Any = None
) -> tuple[Any, dict[str, Any]]:
    """The target as a generator of cfg's backend (`generate(prompts, seeds, temperature=None)`
    -> (token ids, text, finish reason) per prompt; `close()`), and the engine settings it runs
    with. `llm`: a started vllm.LLM to reuse (close() leaves it running)."""
    if cfg.backend == "hf":
        gen: Any = _HfBackendGenerator(cfg, tok)
        dtype = str(gen.gen.model.dtype).removeprefix("torch.")
        return gen, {"backend": "hf", "device": gen.gen.device, "dtype": dtype}
    if cfg.backend == "server":
        return _open_server(cfg)
    engine = engine_kwargs(
        cfg.target,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        tensor_parallel_size=cfg.tensor_parallel_size,
        seed=cfg.seed,
        enable_prefix_caching=False,
        trust_remote_code=cfg.trust_remote_code,
        per_request_seeds=True,  # sampled turns and refine's rollouts are seeded per request
    )
    owned = llm is None
    if owned:
        setup_cpu_env()
        from vllm import LLM

        llm = LLM(**engine)
        record_engine_processes()
    return _VllmGenerator(llm, cfg, owned=owned), engine


def _open_server(cfg: RegenerateConfig) -> tuple[_ServerGenerator, dict[str, Any]]:
    """The server at cfg.server_url, or vLLM's server for the target, started now (its log in
    the out dir) and stopped by the generator's close()."""
    if cfg.server_url:
        gen = _ServerGenerator(cfg, cfg.server_url, cfg.served_model_name)
        return gen, {"backend": "server", "base_url": gen.client.base_url, "started": False}
    stack = contextlib.ExitStack()
    try:
        server = stack.enter_context(
            start_vllm_server(
                cfg.target,
                log_path=Path(cfg.out) / SERVER_LOG,
                served_model_name=cfg.served_model_name,
                reasoning_parser=cfg.reasoning_parser,
                dtype=cfg.dtype,
                max_model_len=cfg.max_model_len,
                seed=cfg.seed,
                tensor_parallel_size=cfg.tensor_parallel_size,
                trust_remote_code=cfg.trust_remote_code,
            )
        )
    except BaseException:
        stack.close()
        raise
    gen = _ServerGenerator(cfg, server.base_url, server.model, owned=stack)
    return gen, {
        "backend": "server",
        "base_url": server.base_url,
        "started": True,
        "reasoning_parser": cfg.reasoning_parser,
        "startup_s": round(server.startup_s, 1),
        "log": SERVER_LOG,
    }


def _regenerate_batch(
    gen: Any,
    tok: ChatRenderer,
    convs: list[tuple[int, Conversation]],
    cfg: RegenerateConfig,
    stats: _Stats,
) -> list[dict[str, Any]]:
    """Regenerate one batch turn by turn; returns the output rows (in input order). Each
    regenerated turn keeps the ids the target generated and the prompt ids it was given."""
    states = [
        {
            "row": row_index,
            "conv": conv,
            "points": generation_points(conv.messages),
            "out": [],
            "next": 0,
            "done": False,
            "kwargs": tok.kwargs_for(conv.chat_template_kwargs),
            "source": conv.source or str(cfg.data),
        }
        for row_index, conv in convs
    ]
    turn = 0
    while True:
        active = _prompt_turn(states, turn, tok, cfg, stats)
        if not active:
            break
        outputs = _generate_turns(gen, active, cfg, turn)
        for st, generated in zip(active, outputs, strict=True):
            context, prompt_ids = st.pop("pending")
            _take_turn(st, context, prompt_ids, generated, tok, cfg, stats)
        turn += 1
    return [_output_row(st) for st in states if any(m["role"] == "assistant" for m in st["out"])]


def _prompt_turn(
    states: list[dict[str, Any]], turn: int, tok: ChatRenderer, cfg: RegenerateConfig, stats: _Stats
) -> list[dict[str, Any]]:
    """The conversations that go on to their `turn`-th generation, each with its prompt
    (`pending`: the context and its ids); a conversation out of turns, or whose prompt is longer
    than max_model_len leaves room for, is done (the latter counted as dropped)."""
    max_prompt = cfg.max_model_len - cfg.max_new_tokens
    active = []
    for st in states:
        if st["done"] or turn >= len(st["points"]):
            st["done"] = True
            continue
        point = st["points"][turn]
        prev = st["points"][turn - 1] + 1 if turn else 0
        context = st["out"] + [dict(m) for m in st["conv"].messages[prev:point]]
        ids = tok.prompt_ids(context, st["kwargs"])
        if len(ids) > max_prompt:
            stats.dropped["prompt_too_long" if turn == 0 else "truncated_too_long"] += 1
            st["done"] = True
            continue
        st["pending"] = (context, ids)
        active.append(st)
    return active


def _generate_turns(
    gen: Any, active: list[dict[str, Any]], cfg: RegenerateConfig, turn: int
) -> list[GeneratedTurn]:
    """One turn for each active conversation: through the chat API (a server), or from its prompt
    ids (an engine); seeded per row and turn unless greedy."""
    seeds = [
        None if cfg.temperature == 0 else (cfg.seed * 1_000_003 + st["row"] * 1009 + turn) % (2**31)
        for st in active
    ]
    if getattr(gen, "chat", False):
        contexts = [st["pending"][0] for st in active]
        return gen.generate_turns(contexts, seeds, [st["kwargs"] for st in active])
    prompts = [st["pending"][1] for st in active]
    return [
        GeneratedTurn(prompt, list(ids), "", None, finish)
        for prompt, (ids, _, finish) in zip(prompts, gen.generate(prompts, seeds), strict=True)
    ]


def _output_row(st: dict[str, Any]) -> dict[str, Any]:
    """A regenerated conversation as an output row."""
    conv = st["conv"]
    row = {"id": conv.sample_id, "messages": st["out"]}
    if conv.category is not None:  # kept for per-category figures downstream
        row["category"] = conv.category
    if conv.chat_template_kwargs is not None:
        row["chat_template_kwargs"] = conv.chat_template_kwargs
    if conv.source is not None:
        row["source"] = conv.source
    return row


def _take_turn(
    st: dict[str, Any],
    context: list[dict[str, Any]],
    rendered: list[int],
    generated: GeneratedTurn,
    tok: ChatRenderer,
    cfg: RegenerateConfig,
    stats: _Stats,
) -> None:
    """Append one generated turn to a conversation's output, or end the conversation (an empty
    turn; a cut one with `drop_truncated`), counting either way. `rendered`: the prompt as this
    stage's template renders it; a server's own prompt ids win where it returns them (they are
    what the target saw), a difference counted."""
    first = not any(m["role"] == "assistant" for m in st["out"])
    source = stats.by_source.setdefault(st["source"], Counter())
    finish_reason, token_ids = generated.finish_reason, generated.token_ids
    prompt_ids = generated.prompt_token_ids or rendered
    stats.reasoning["prompt_ids_differ_from_template"] += prompt_ids != rendered
    stats.finish[finish_reason] += 1
    source["generated"] += 1
    source["hit_max_new_tokens"] += finish_reason == "length"
    if token_ids is None:  # a server that returns text only: prepare checks its alignment
        stats.reasoning["turns_without_ids"] += 1
        reasoning, answer = generated.reasoning, generated.content
    else:
        stats.generated_tokens += len(token_ids)
        reasoning, answer = tok.split_generated(prompt_ids, token_ids, st["kwargs"])
    if not answer.strip() and not (reasoning or "").strip():
        stats.dropped["empty_answer" if first else "truncated_empty_answer"] += 1
        st["done"] = True
        return
    if finish_reason == "length" and cfg.drop_truncated:
        stats.dropped["hit_max_new_tokens" if first else "truncated_hit_max_new_tokens"] += 1
        st["done"] = True
        return
    stats.turns += 1
    message: dict[str, Any] = {"role": "assistant", "content": answer}
    if reasoning is not None:
        message["reasoning"] = reasoning
    if token_ids is not None:
        num_reasoning = tok.num_reasoning_ids(prompt_ids, token_ids, st["kwargs"])
        stats.reasoning["turns_with_reasoning"] += bool(num_reasoning)
        stats.reasoning["reasoning_tokens"] += num_reasoning
        stats.reasoning["answer_tokens"] += len(token_ids) - num_reasoning
        message.update(token_ids=token_ids, prompt_token_ids=prompt_ids)
    else:
        stats.reasoning["turns_with_reasoning"] += reasoning is not None
    message["finish_reason"] = finish_reason
    st["out"] = context + [message]


def _append_rows(path: Path, rows: list[dict[str, Any]]) -> int:
    """Append rows as JSON lines, flush + fsync; returns the file size afterwards."""
    with open(path, "ab") as f:
        for r in rows:
            f.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def run_regenerate(
    cfg: RegenerateConfig, llm: Any = None, on_batch: Callable[[int, int], None] | None = None
) -> RegenerateResult:
    """See `_regenerate`; one writer per out dir (eagle3.lock), which also records the engine's
    processes."""
    cfg.require("target", "data", "out")
    with dir_lock(cfg.out, "regenerate out"):
        return _regenerate(cfg, llm, on_batch)


def _regenerate(
    cfg: RegenerateConfig,
    llm: Any = None,
    on_batch: Callable[[int, int], None] | None = None,
) -> RegenerateResult:
    """Regenerate `cfg.data`'s assistant turns with `cfg.target`; see the module docstring.

    `llm`: an existing `vllm.LLM` for `cfg.target` to reuse (tests, notebooks); by default one is
    built with `eagle3.vllm_engine.engine_kwargs`. `on_batch(batch_index, rows_done)` is called
    after each batch is durably written (progress reporting; raising in it stops the run resumably).
    """
    cfg.require("target", "data", "out")
    t0 = time.time()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    fp = _fingerprint(cfg)
    finished = _finished_manifest(cfg, out, fp)
    if finished is not None:
        log.info("%s is complete for these settings; nothing to do", out / OUTPUT)
        return _result_from_manifest(out, finished, time.time() - t0)

    read = _read_input(cfg)
    convs = list(enumerate(read.conversations))
    weights = target_fingerprint(cfg.target)  # every weight file: the model of the answers
    start, stats = _resume(cfg, out, fp, weights, len(convs))

    tok = open_renderer(cfg)
    if cfg.backend == "server":  # its split must be the template's own
        tok.check_reasoning_parser(cfg.reasoning_parser)
    gen, engine = open_generator(cfg, tok, llm)
    if isinstance(gen, _VllmGenerator):
        gen.owned = False  # as before: the engine lives as long as this process (or `llm`)
    try:
        written = _count_lines(out / PARTIAL) if start else 0
        gen_t0, gen_tokens0 = time.time(), stats.generated_tokens
        progress = {"fingerprint": fp, "target_fingerprint": weights}
        written = _write_batches(cfg, gen, tok, convs, start, stats, written, progress, on_batch)
    finally:
        if getattr(gen, "chat", False):
            engine["requests"] = gen.client.counts.to_json()
            gen.close()  # a server the stage started stops here, on success or failure

    elapsed = time.time() - t0
    decode_tokens_per_s = (stats.generated_tokens - gen_tokens0) / max(time.time() - gen_t0, 1e-9)
    manifest = _manifest(cfg, fp, weights, read, stats, written, tok, engine)
    manifest.update(
        decode_tokens_per_s_this_run=round(decode_tokens_per_s, 1),
        resumed_from_row=start,
        elapsed_s=round(elapsed, 1),
        vllm_version=_vllm_version(),
        notes="answers that hit max_new_tokens (finish reason `length`) are kept as generated"
        if not cfg.drop_truncated
        else "turns that hit max_new_tokens end their conversation (drop_truncated)",
    )
    os.replace(out / PARTIAL, out / OUTPUT)
    write_json(out / MANIFEST, manifest)
    (out / PROGRESS).unlink(missing_ok=True)
    return _result_from_manifest(out, manifest, elapsed)


def _read_input(cfg: RegenerateConfig) -> Any:
    """The conversations to regenerate (eagle3.chat_formats.read_conversations); an error when
    more rows than cfg.max_skipped_fraction cannot be read."""
    read = read_conversations(cfg.data, limit=cfg.limit, require_assistant=False)
    check_skipped(
        read.source,
        read.num_rows,
        read.skipped,
        read.skip_rows,
        cfg.max_skipped_fraction,
        "regenerate:",
    )
    return read


def _manifest(
    cfg: RegenerateConfig,
    fp: str,
    weights: Any,
    read: Any,
    stats: _Stats,
    written: int,
    tok: ChatRenderer,
    engine: dict[str, Any],
) -> dict[str, Any]:
    """The finished run's manifest: its settings, the target's weights, the counts, the chat
    template and the engine (the run's timings are added by the caller)."""
    return {
        "stage": "regenerate",
        "fingerprint": fp,
        "limit": cfg.limit,
        "target": str(cfg.target),
        "target_fingerprint": weights,
        "data": str(cfg.data),
        "output": OUTPUT,
        "counts": {
            "input_rows": read.num_rows,
            "read_conversations": len(read.conversations),
            "written_conversations": written,
            "regenerated_turns": stats.turns,
            "generated_tokens": stats.generated_tokens,
            "input_skipped": dict(read.skipped),
            "dropped": dict(stats.dropped),
            **dict(stats.reasoning),
        },
        "finish_reasons": dict(stats.finish),
        #: per source: the share of generated turns that hit max_new_tokens (cut traces)
        "truncated_share": stats.truncated_share(),
        "chat": tok.identity(),
        "input_formats": dict(read.formats),
        "input_turns": dict(read.turns),
        "config": cfg.model_dump(mode="json"),
        "engine": dict(engine),
    }


def _finished_manifest(cfg: RegenerateConfig, out: Path, fp: str) -> dict[str, Any] | None:
    """The manifest of the finished regeneration in `out` when it was made with these settings
    and target weights (an error when with others); None when `out` holds none."""
    if not ((out / OUTPUT).is_file() and (out / MANIFEST).is_file()):
        return None
    manifest = read_json(out / MANIFEST)
    if manifest.get("fingerprint") == fp and manifest.get("limit") == cfg.limit:
        before, now = manifest.get("target_fingerprint"), target_fingerprint(cfg.target)
        differs = before and now and describe_difference(before, now)
        if differs:  # same path and settings, other weights: the answers are another model's
            raise ValueError(
                f"{out / MANIFEST}: these answers were written by other target "
                f"weights ({differs}); regenerate them into a new --out, or "
                f"delete {out}"
            )
        return manifest
    raise ValueError(
        f"{out} already holds a finished regeneration made with other settings "
        f"(manifest fingerprint {manifest.get('fingerprint', '?')[:12]}, limit "
        f"{manifest.get('limit')}); pass a new --out or delete the directory"
    )


def _resume(
    cfg: RegenerateConfig, out: Path, fp: str, weights: Any, num_convs: int
) -> tuple[int, _Stats]:
    """Where an interrupted run of these settings and weights stopped: the conversations done and
    the counts so far, the partial output cut back to its last recorded batch. (0, fresh counts)
    and an empty partial output when there is none."""
    partial, progress_path = out / PARTIAL, out / PROGRESS
    if not (progress_path.is_file() and partial.is_file()):
        partial.unlink(missing_ok=True)
        progress_path.unlink(missing_ok=True)
        partial.touch()
        return 0, _Stats()
    prog = read_json(progress_path)
    if prog.get("fingerprint") != fp:
        raise ValueError(
            f"{progress_path} belongs to a run with other settings "
            f"({', '.join(_FINGERPRINT_FIELDS)} must match to resume); pass a new --out or "
            f"delete {out}"
        )
    before = prog.get("target_fingerprint")
    differs = before and weights and describe_difference(before, weights)
    if differs:
        raise ValueError(
            f"{progress_path}: the answers so far were written by other target "
            f"weights ({differs}); resuming would mix two models: pass a new "
            f"--out or delete {out}"
        )
    start, stats = int(prog["rows_done"]), _Stats.from_json(prog["stats"])
    if start > num_convs:
        raise ValueError(
            f"{progress_path}: {start} rows are already done but --limit {cfg.limit} leaves "
            f"{num_convs}; rerun with the earlier (or no) --limit, or a new --out"
        )
    with open(partial, "r+b") as f:  # drop a batch that was appended but not recorded
        f.truncate(int(prog["bytes"]))
    log.info("resuming %s after %d of %d conversations", out, start, num_convs)
    return start, stats


def _write_batches(
    cfg: RegenerateConfig,
    gen: Any,
    tok: ChatRenderer,
    convs: list[tuple[int, Conversation]],
    start: int,
    stats: _Stats,
    written: int,
    progress: dict[str, Any],
    on_batch: Callable[[int, int], None] | None,
) -> int:
    """Regenerate convs[start:] batch by batch, appending each batch's rows to the partial output
    and recording it in progress.json (with `progress`'s keys) before the next; the number of
    rows written in all."""
    from tqdm import tqdm

    out, bs = Path(cfg.out), cfg.batch_size
    bar = tqdm(total=len(convs), initial=start, desc="regenerate", unit="conv", dynamic_ncols=True)
    gen_t0, gen_tokens0 = time.time(), stats.generated_tokens
    for batch_index, b in enumerate(range(start, len(convs), bs), start=start // bs):
        rows = _regenerate_batch(gen, tok, convs[b : b + bs], cfg, stats)
        size = _append_rows(out / PARTIAL, rows)
        written += len(rows)
        done = min(b + bs, len(convs))
        write_json(
            out / PROGRESS,
            {
                "fingerprint": progress["fingerprint"],
                "rows_done": done,
                "bytes": size,
                "written": written,
                "stats": stats.to_json(),
                "target_fingerprint": progress["target_fingerprint"],
            },
        )
        bar.update(done - b)
        rate = (stats.generated_tokens - gen_tokens0) / max(time.time() - gen_t0, 1e-9)
        bar.set_postfix(tok_s=f"{rate:.0f}", written=written)
        if on_batch is not None:
            on_batch(batch_index, done)
    bar.close()
    return written


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def _vllm_version() -> str:
    try:
        import vllm

        return vllm.__version__
    except Exception:  # pragma: no cover
        return "unknown"


def _result_from_manifest(out: Path, manifest: dict[str, Any], elapsed: float) -> RegenerateResult:
    c = manifest["counts"]
    skipped = {**c["input_skipped"], **c["dropped"]}
    return RegenerateResult(
        out=out,
        conversations_path=out / OUTPUT,
        num_rows=c["input_rows"],
        num_written=c["written_conversations"],
        num_turns=c["regenerated_turns"],
        generated_tokens=c["generated_tokens"],
        finish_reasons=manifest["finish_reasons"],
        skipped=skipped,
        resumed_from_row=manifest.get("resumed_from_row", 0),
        elapsed_s=round(elapsed, 1),
        manifest=manifest,
        reasoning_tokens=c.get("reasoning_tokens", 0),
        truncated_share=manifest.get("truncated_share", {}),
    )
