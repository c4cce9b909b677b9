"""vLLM backend of the capture stage (driver side; public vLLM API only).

Starts one ``vllm.LLM`` with the worker extension of :mod:`eagle3.vllm_ext`, runs prompts as
prefill-only requests (``SamplingParams(max_tokens=1)``) and collects the per-token states through
``llm.collective_rpc``. All knowledge of vLLM internals lives in vllm_ext.py.

Engine settings and why: ``enable_prefix_caching=False`` (a cached prefix is never forwarded, so its
states could not be recorded); ``enforce_eager=True`` (aux layers are switched on after start-up,
which a torch.compile'd graph would ignore); ``max_num_batched_tokens=batch_tokens`` with chunked
prefill, so prompts longer than a step are split over steps (the extension reassembles them).
Scripts that create an engine need an ``if __name__ == "__main__":`` guard (vLLM spawns a process).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagle3.config import ConfigError
from eagle3.lock import record_engine_processes
from eagle3.quant import Stored
from eagle3.vllm_engine import (
    engines_die_with_parent,
    gpu_memory_utilization,
    on_cpu_platform,
    shutdown_engine,
    use_spawned_engine_workers,
)
from eagle3.vllm_ext import decode_scales, decode_states
from eagle3.vllm_support import UnsupportedVLLMError, check_vllm_version

from .routing import RoutedRows

log = logging.getLogger(__name__)

EXTENSION = "eagle3.vllm_ext.CaptureWorkerExtension"


def engine_kwargs(
    target: str,
    dtype: str,
    batch_tokens: int,
    max_model_len: int,
    tensor_parallel_size: int,
    max_num_seqs: int = 256,
) -> dict[str, Any]:
    """LLM(...) arguments shared by capture and the plain-prefill baseline of the benchmark."""
    share = gpu_memory_utilization()
    extra = {} if share is None or on_cpu_platform() else {"gpu_memory_utilization": share}
    use_spawned_engine_workers()
    return dict(
        **extra,
        model=target,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_batched_tokens=batch_tokens,
        max_num_seqs=min(max_num_seqs, batch_tokens),
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        enforce_eager=True,
        tensor_parallel_size=tensor_parallel_size,
        seed=0,
    )


@dataclass
class WorkerStates:
    """A sample's states held by the TP-rank-0 worker (capture.writer = "worker"): its internal
    request id."""

    rid: str
    finite: bool
    num_tokens: int


class VLLMBackend:
    name = "vllm"

    def __init__(
        self,
        target: str,
        aux_layer_ids: list[int],
        dtype: str,
        batch_tokens: int,
        max_model_len: int,
        tensor_parallel_size: int = 1,
        llm: Any = None,
        storage_dtype: str | None = None,
        **engine_overrides: Any,
    ):
        self.target, self.aux_layer_ids = target, list(aux_layer_ids)
        self.storage_dtype = storage_dtype  # None: the engine dtype
        self.kwargs = engine_kwargs(
            target, dtype, batch_tokens, max_model_len, tensor_parallel_size
        )
        self.kwargs.update(engine_overrides)
        self.batch_tokens = batch_tokens
        self.llm = (
            llm  # an engine already built with worker_extension_cls=EXTENSION may be passed in
        )
        self._owns = llm is None

    def start(self) -> dict[str, Any]:
        if self.llm is None:
            check_vllm_version()  # one line for a vLLM outside the tested range
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            from vllm import LLM

            engines_die_with_parent()
            self.llm = LLM(worker_extension_cls=EXTENSION, **self.kwargs)
            # in the out dir's lock file: a later run finds them if they outlive this one
            record_engine_processes()
        infos = self.llm.collective_rpc(
            "eagle3_capture_start", args=(self.aux_layer_ids, self.storage_dtype)
        )
        info = dict(infos[0])
        # the extension's diagnosis (a runner it does not know, aux ids the target cannot give)
        refusal = info.get("config_error") or info.get("unsupported")
        if refusal:
            if self._owns:
                llm, self.llm = self.llm, None
                shutdown_engine(llm)
            raise (ConfigError if "config_error" in info else UnsupportedVLLMError)(refusal)
        log.info(
            "capture: vLLM %s, model runner %s (%s)",
            info.get("vllm_version"),
            info.get("runner"),
            info.get("runner_class"),
        )
        # Prompts per generate() call: many engine steps' worth keeps the engine full (a partly
        # filled step only at the end of each call), while the worker's buffered states stay <= ~1
        # GiB. The worker buffers states in the storage dtype (fp8: 1 byte + scales).
        item = {"float32": 4, "fp8": 1}.get(info.get("storage_dtype") or info["dtype"], 2)
        per_token = (len(self.aux_layer_ids) + 1) * int(info["hidden_size"]) * item
        info["chunk_tokens"] = max(
            self.batch_tokens, min(max(8 * self.batch_tokens, 16384), (1 << 30) // per_token)
        )
        return info

    def _prefill(self, samples: list[np.ndarray]) -> list[Any]:
        """Run each sample as a prompt with one greedy token to generate: the forward whose
        states the worker records."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in s]) for s in samples]
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        return self.llm.generate(prompts, params, use_tqdm=False)

    def capture(self, samples: list[np.ndarray]) -> list[Any]:
        """States of each sample in storage form (eagle3.quant.Stored: [T, A + 1, H], aux in
        `aux_layer_ids` order then last; converted inside the worker)."""
        outputs = self._prefill(samples)
        popped = self.llm.collective_rpc("eagle3_capture_pop")[0]  # TP rank 0 holds the states
        by_external = {}
        for rid, enc in popped.items():
            states, filled = decode_states(enc)  # [T, A+1, H] storage dtype
            st = Stored(states, decode_scales(enc), bool(enc.get("finite", True)))
            by_external[rid.rsplit("-", 1)[0]] = (rid, st, filled)
        result: list[Any] = []
        for out, sample in zip(outputs, samples, strict=True):
            rid, st, filled = _recorded(by_external, out.request_id)
            _check_every_position(rid, st.states.shape[0], filled, len(sample))
            result.append(st)
        return result

    def route(self, samples: list[np.ndarray]) -> RoutedRows:
        """The expert ids vLLM's MoE routers choose for every token of each sample (hook 9 of
        eagle3.vllm_ext), as RoutedRows ([T, L, K] int16 per sample). Call after start(); the
        states these forwards record are dropped."""
        info = self.llm.collective_rpc("eagle3_routing_start")[0]
        if info.get("unsupported"):
            raise UnsupportedVLLMError(info["unsupported"])
        try:
            outputs = self._prefill(samples)
            popped = self.llm.collective_rpc("eagle3_routing_pop")[0]
        finally:
            self.llm.collective_rpc("eagle3_routing_stop")
        by_external = {rid.rsplit("-", 1)[0]: (rid, enc) for rid, enc in popped.items()}
        ids = []
        for out, sample in zip(outputs, samples, strict=True):
            rid, enc = _recorded(by_external, out.request_id)
            _check_every_position(rid, enc["shape"][0], enc["filled"], len(sample))
            ids.append(np.frombuffer(enc["data"], dtype=np.int16).reshape(enc["shape"]))
        return RoutedRows(list(info["moe_layer_ids"]), ids, "vLLM's FusedMoE routers")

    # ---- capture.writer = "worker": the TP-rank-0 worker writes the shards (eagle3.vllm_ext) ----

    def capture_refs(self, samples: list[np.ndarray]) -> list[WorkerStates]:
        """Like `capture`, but the states stay in the worker: one WorkerStates handle per sample
        (same checks: every position recorded). Non-finite samples are dropped in the worker at once
        (the driver skips them)."""
        outputs = self._prefill(samples)
        meta = self.llm.collective_rpc("eagle3_capture_meta")[0]  # TP rank 0 holds the states
        by_external = {rid.rsplit("-", 1)[0]: (rid, m) for rid, m in meta.items()}
        result, bad = [], []
        for out, sample in zip(outputs, samples, strict=True):
            rid, m = _recorded(by_external, out.request_id)
            _check_every_position(rid, m["num_tokens"], m["filled"], len(sample))
            if not m["finite"]:
                bad.append(rid)
            result.append(WorkerStates(rid, bool(m["finite"]), len(sample)))
        if bad:
            self.llm.collective_rpc("eagle3_capture_drop", args=(bad,))
        return result

    def start_write_shard(
        self,
        out: str,
        shard_id: int,
        buf: Any,
        rids: list[str],
        num_aux: int,
        hidden_size: int,
        storage_dtype: str,
        background: str = "auto",
    ) -> None:
        """Have the worker write shard `shard_id` of `buf` (an eagle3.shards.ShardBuffer holding the
        driver's bookkeeping: indices, sample ids, input_ids, loss_mask, skips) with the states of
        `rids`; on a GPU engine it writes in the background. `wait_shard(shard_id)` returns its
        progress entry."""
        rows = [
            [rid, i, sid, ids.tolist(), mask.tolist()]
            for rid, i, sid, ids, mask in zip(
                rids, buf.sample_index, buf.sample_ids, buf.input_ids, buf.loss_mask, strict=True
            )
        ]
        got = self.llm.collective_rpc(
            "eagle3_capture_write_shard",
            args=(
                str(out),
                shard_id,
                rows,
                buf.first_index,
                buf.next_index,
                dict(buf.skipped),
                num_aux,
                hidden_size,
                storage_dtype,
                background,
            ),
        )[0]
        if got is None:
            raise RuntimeError(
                "capture (vllm): TP rank 0 did not take the shard (no states kept there?)"
            )

    def wait_shard(self, shard_id: int) -> dict[str, Any]:
        """The progress entry of a shard started with start_write_shard, once its file is
        complete."""
        return self.llm.collective_rpc("eagle3_capture_wait_shard", args=(shard_id,))[0]

    def close(self) -> None:
        if self.llm is not None:
            self.llm.collective_rpc("eagle3_capture_stop")
            # its engine processes end now, while the out dir's lock (which lists them) is held
            if self._owns:
                llm, self.llm = self.llm, None
                shutdown_engine(llm)


def _recorded(by_external: dict[str, tuple], request_id: str) -> tuple:
    """What the worker recorded for the request `request_id` (vLLM may add a suffix to the id)."""
    got = by_external.get(request_id) or by_external.get(request_id.rsplit("-", 1)[0])
    if got is None:
        raise RuntimeError(f"capture (vllm): no states recorded for request {request_id}")
    return got


def _check_every_position(rid: str, num_tokens: int, filled: int, prompt_len: int) -> None:
    """RuntimeError unless the worker recorded every position of the prompt."""
    if num_tokens != prompt_len or filled != prompt_len:
        raise RuntimeError(
            f"capture (vllm): request {rid} recorded {filled}/{num_tokens} "
            f"positions of a {prompt_len}-token prompt (prefix caching on?)"
        )
