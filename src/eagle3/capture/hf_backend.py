"""transformers backend of the capture stage: plain forward with output_hidden_states.

Importable and runnable without vLLM (the GPU training box has none): only torch/transformers,
imported lazily. Same outputs as the vLLM backend:
  aux id k     -> ``output_hidden_states[k]`` (output of decoder layer k-1, hidden + residual)
  "last"       -> the input of the final norm, taken with a forward pre-hook on ``model.norm``
                  (``output_hidden_states[L]`` is AFTER the final norm for Llama/Qwen3, so
                  unusable).
Samples are right-padded into batches of at most ``batch_tokens`` padded tokens; with a causal mask
the real tokens never see the padding, so their states equal an unpadded forward.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from eagle3.config import ConfigError
from eagle3.hf import load_causal_lm
from eagle3.quant import Stored, stack_to_storage

from .routing import RoutedRows, RouterSpec, route_logits, router_spec


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"CaptureConfig.device = {device!r} but CUDA is not available: use --device cpu or auto"
        )
    return device


def _final_norm(model: Any) -> Any:
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    for cand in (base, getattr(base, "language_model", None)):
        if cand is not None and hasattr(cand, "norm"):
            return cand.norm
    raise RuntimeError(
        f"capture (hf backend): cannot find the final norm of {type(model).__name__} (expected "
        ".model.norm)"
    )


class HFBackend:
    name = "hf"

    def __init__(
        self,
        target: str,
        aux_layer_ids: list[int],
        dtype: str,
        device: str,
        batch_tokens: int,
        storage_dtype: str | None = None,
        trust_remote_code: bool = False,
    ):
        self.target, self.aux_layer_ids, self.dtype_name = target, list(aux_layer_ids), dtype
        self.trust_remote_code = trust_remote_code
        self.storage_dtype = storage_dtype or dtype
        self.device = resolve_device(device)
        self.batch_tokens = batch_tokens
        self.model: Any = None

    def start(self) -> dict[str, Any]:
        dtype = getattr(torch, self.dtype_name)
        self.model = (
            load_causal_lm(self.target, dtype=dtype, trust_remote_code=self.trust_remote_code)
            .to(self.device)
            .eval()
        )
        self._pre_norm: list[Any] = []
        _final_norm(self.model).register_forward_pre_hook(
            lambda _m, args: self._pre_norm.append(args[0])
        )
        return {"device": self.device, "chunk_tokens": self.batch_tokens}

    def capture(self, samples: list[np.ndarray]) -> list[Any]:
        """States of each sample in storage form (eagle3.quant.Stored: [T, A + 1, H], aux in
        `aux_layer_ids` order then last), converted on the device, returned on CPU."""
        out: list[Any] = [None] * len(samples)
        order = sorted(range(len(samples)), key=lambda i: len(samples[i]))
        batch: list[int] = []
        for i in order + [None]:  # type: ignore[list-item]
            if i is not None and (
                not batch or (len(batch) + 1) * len(samples[i]) <= self.batch_tokens
            ):
                batch.append(i)
                continue
            if batch:
                self._run(samples, batch, out, torch)
            batch = [i] if i is not None else []
        return out

    def _run(self, samples: list[np.ndarray], batch: list[int], out: list[Any], torch: Any) -> None:
        lens = [len(samples[i]) for i in batch]
        t_max = max(lens)
        ids = torch.zeros((len(batch), t_max), dtype=torch.long)  # [B, Tmax]
        mask = torch.zeros((len(batch), t_max), dtype=torch.long)  # [B, Tmax]
        for r, i in enumerate(batch):
            ids[r, : lens[r]] = torch.as_tensor(samples[i], dtype=torch.long)
            mask[r, : lens[r]] = 1
        self._pre_norm.clear()
        with torch.inference_mode():
            res = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                output_hidden_states=True,
                use_cache=False,
                logits_to_keep=1,
            )

        hs = res.hidden_states
        last = self._pre_norm[-1]  # [B, Tmax, H]
        # stack + convert to the storage dtype on the device: only storage bytes cross to the CPU
        states, scales, row_ok = stack_to_storage(
            [hs[k] for k in self.aux_layer_ids] + [last], self.storage_dtype
        )
        states = states.cpu()  # [B, Tmax, A+1, H]
        scales = None if scales is None else scales.cpu()  # [B, Tmax, A+1]
        row_ok = row_ok.cpu()  # [B, Tmax]
        for r, i in enumerate(batch):
            n = lens[r]
            # [r, :n] of a contiguous [B, Tmax, ...] tensor is itself contiguous: a view, no copy
            out[i] = Stored(
                states[r, :n], None if scales is None else scales[r, :n], bool(row_ok[r, :n].all())
            )

    def route(self, samples: list[np.ndarray]) -> RoutedRows:
        """The expert ids the target's own MoE gates choose for every token of each sample, as
        RoutedRows ([T, L, K] int16 per sample). A forward hook on each gate takes the indices it
        returns (transformers' DeepSeek-V3 and Qwen3-MoE routers, Kimi's remote-code gate); a gate
        that returns router logits only is routed again from them with eagle3.capture.routing's
        reference router of the target's kind. Batched like capture (right padding: a token's
        routing never sees the padding)."""
        gates = moe_gates(self.model)
        spec = router_spec(self.model.config.to_dict())
        if not gates or spec is None:
            return RoutedRows([], [np.zeros((len(s), 0, 0), np.int16) for s in samples], "")
        got: dict[int, list[Any]] = {}

        def keep(slot: int) -> Any:
            def hook(module: Any, _args: Any, output: Any) -> None:
                got.setdefault(slot, []).append(gate_ids(module, output, spec))

            return hook

        handles = [g.register_forward_hook(keep(i)) for i, (_, g) in enumerate(gates)]
        out: list[Any] = [None] * len(samples)
        try:
            for batch in _batches(samples, self.batch_tokens):
                got.clear()
                lens = [len(samples[i]) for i in batch]
                ids, mask = _padded([samples[i] for i in batch], max(lens))  # [B, Tmax]
                with torch.inference_mode():
                    self.model(
                        input_ids=ids.to(self.device),
                        attention_mask=mask.to(self.device),
                        use_cache=False,
                        logits_to_keep=1,
                    )
                routed = torch.stack(
                    [torch.cat(got[i]).view(len(batch), max(lens), -1) for i in range(len(gates))],
                    dim=2,
                )  # [B, Tmax, L, K]
                for r, i in enumerate(batch):
                    out[i] = routed[r, : lens[r]].to(torch.int16).numpy()
        finally:
            for h in handles:
                h.remove()
        return RoutedRows([lid for lid, _ in gates], out, "the transformers model's MoE gates")

    def close(self) -> None:
        self.model = None


def moe_gates(model: Any) -> list[tuple[int, Any]]:
    """The MoE layers' routers of a transformers model: the `gate` of each module that holds both
    `gate` and `experts` (DeepSeek-V3's DeepseekV3MoE, Qwen3-MoE's sparse block, Kimi's MoE), as
    (decoder layer index, gate) by layer index."""
    found = []
    for name, module in model.named_modules():
        gate = getattr(module, "gate", None)
        if not isinstance(gate, torch.nn.Module) or not hasattr(module, "experts"):
            continue
        m = re.search(r"\.layers\.(\d+)\.", f".{name}.")
        if m is None:
            raise RuntimeError(
                f"capture (hf backend): MoE block {name!r} has no decoder layer index "
                "(layers.<i>.) in its name"
            )
        found.append((int(m.group(1)), gate))
    return sorted(found, key=lambda x: x[0])


def gate_ids(gate: Any, output: Any, spec: RouterSpec) -> Any:
    """A gate's expert ids [N, K] (int64, on the CPU) from its forward output: the integer tensor it
    returns (the model's own routing), or, for a gate that returns logits [N, E] only, the
    reference router of `spec` on them (with the gate's e_score_correction_bias)."""
    parts = output if isinstance(output, tuple | list) else (output,)
    for x in parts:
        if torch.is_tensor(x) and not x.is_floating_point() and x.dim() == 2:
            return x.detach().to("cpu", torch.int64)
    logits = parts[0]
    if not torch.is_tensor(logits) or logits.shape[-1] != spec.num_experts:
        raise RuntimeError(
            f"capture (hf backend): the MoE gate {type(gate).__name__} returned neither expert "
            f"ids nor [tokens, {spec.num_experts}] router logits"
        )
    bias = getattr(gate, "e_score_correction_bias", None)
    return route_logits(logits.reshape(-1, spec.num_experts), spec, bias)


def _batches(samples: list[np.ndarray], batch_tokens: int) -> list[list[int]]:
    """Sample indices in batches of at most `batch_tokens` padded tokens (at least one sample),
    shortest first: capture's batching."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(samples[i]) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _padded(rows: list[np.ndarray], t_max: int) -> tuple[Any, Any]:
    """Right-padded input ids and attention mask, both [B, t_max] int64."""
    ids = torch.zeros((len(rows), t_max), dtype=torch.long)  # [B, Tmax]
    mask = torch.zeros((len(rows), t_max), dtype=torch.long)  # [B, Tmax]
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[r, : len(row)] = 1
    return ids, mask
