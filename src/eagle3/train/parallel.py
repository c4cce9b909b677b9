"""All parallelism in one place: torchrun env -> process group; DDP for small drafts, FSDP2 for
large.

Single process (CPU or one GPU) is the no-op case. Data parallelism is by packed row
(data.PackedLoader walks one global order and each rank keeps rows rank::world), so a step of
batch_size x grad_accum x world rows trains the same rows whatever the split between ranks and
micro-batches. Checkpoints hold the full
(unsharded) weights and optimizer state, keyed as one process's optimizer keys them
            (`full_optimizer_state`),
so a run resumes at another world size or wrapping (DDP <-> FSDP2 <-> one process).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: train.runtime.parallel: auto picks fsdp2 when 16 B per trainable parameter (fp32 weight +
#: gradient + two AdamW moments) exceed this share of one GPU's memory: the rest is left to
#: activations (K x T x hidden per layer)
AUTO_FSDP2_MEMORY_SHARE = 0.25


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # setup() created the process group: teardown() destroys it

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup(device: str = "auto") -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":  # no index: this process's local rank (torch.cuda.set_device needs one)
        device = f"cuda:{local}"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = world > 1 and not dist.is_initialized()
    if owns:  # else the caller's group is used (and kept): several trainings in one launch share it
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(int(os.environ.get("RANK", "0")), world, local, dev, owns)


def choose_parallel(wanted: str, model: torch.nn.Module, d: Dist) -> str:
    """The wrapping `wrap` applies for train.runtime.parallel = `wanted`: "none" in one process;
    auto -> "fsdp2" when the trainable parameters' fp32 weights + gradients + AdamW moments (16 B
    each) exceed AUTO_FSDP2_MEMORY_SHARE of one GPU's memory, else "ddp" (always "ddp" on the
    CPU)."""
    if d.world == 1:
        return "none"
    if wanted in ("ddp", "fsdp2"):
        return wanted
    if wanted == "fsdp":
        return "fsdp2"
    if wanted != "auto":
        raise ValueError(f"train.runtime.parallel = {wanted!r}: expected auto, ddp or fsdp2")
    if d.device.type != "cuda":
        return "ddp"
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = torch.cuda.get_device_properties(d.device).total_memory
    return "fsdp2" if 16 * num_params > AUTO_FSDP2_MEMORY_SHARE * total else "ddp"


def wrap(model: torch.nn.Module, d: Dist, fsdp: bool = False) -> torch.nn.Module:
    """DDP (default) or FSDP2 `fully_shard` (drafts too large to replicate). No-op for world == 1.

    FSDP2: each decoder layer is a unit of its own (all-gathered for its forward and backward,
    resharded after), the root holds fc, the norms and the lm_head. The draft runs its layers K
    times per forward (the TTT steps): each call all-gathers the layer again, trading K all-gathers
    for memory."""
    if d.world == 1:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        inner = getattr(model, "draft", model)
        for layer in (inner.midlayer, *inner.layers.values()):
            fully_shard(layer)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel

    # the draft has frozen params (embedding) and buffers; step() is called K times per forward
    return DistributedDataParallel(
        model,
        device_ids=[d.device] if d.device.type == "cuda" else None,
        static_graph=False,
        find_unused_parameters=False,
    )


@contextmanager
def gradient_sync(module: torch.nn.Module, sync: bool) -> Iterator[None]:
    """Inside, with sync False, backward() only accumulates this rank's gradients (no all-reduce
    under DDP, no reduce-scatter under FSDP2): the micro-batches before the last one of a step.
    Enter it once around the forward and the backward (DDP's no_sync is a one-shot context)."""
    if sync:
        yield
        return
    if hasattr(module, "no_sync"):  # DDP
        with module.no_sync():
            yield
        return
    if hasattr(module, "set_requires_gradient_sync"):  # FSDP2
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)
        return
    yield


def full_state_dict(module: torch.nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict; a collective under FSDP, so every rank must call it."""
    if d.world == 1:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def load_full_state_dict(module: torch.nn.Module, sd: dict[str, torch.Tensor], d: Dist) -> None:
    """Load an unsharded state dict (every rank holds it) into a plain, DDP or FSDP2 module;
    non-strict."""
    if d.world == 1:
        module.load_state_dict(sd, strict=False)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, sd, options=StateDictOptions(full_state_dict=True, strict=False))


def _full_tensor(t: Any) -> Any:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def full_optimizer_state(opt: torch.optim.Optimizer, d: Dist) -> dict[str, Any] | None:
    """opt.state_dict() with every state tensor whole (FSDP2's sharded DTensor moments gathered) and
    on the CPU: the dict one process's optimizer holds, keyed by parameter index, whatever the world
    size and wrapping. A collective under FSDP2 (every rank calls it, tensor by tensor); rank 0 gets
    the dict, the other ranks None."""
    sd = opt.state_dict()
    state: dict[Any, dict[str, Any]] = {}
    for idx in sorted(sd["state"]):  # the same order on every rank: the gathers pair up
        entry = {}
        for name, value in sd["state"][idx].items():
            value = _full_tensor(value)
            entry[name] = (
                value.detach().cpu().clone() if torch.is_tensor(value) and d.main else value
            )
        state[idx] = entry
    return {"state": state, "param_groups": sd["param_groups"]} if d.main else None


def load_full_optimizer_state(opt: torch.optim.Optimizer, sd: dict[str, Any], where: str) -> None:
    """Load a `full_optimizer_state` dict (any world size) into `opt`, sharding each moment like its
    parameter when the parameters are FSDP2 DTensors (each rank keeps its own shard: every rank
    holds the whole dict). `where` names the file in errors."""
    params = [p for group in opt.param_groups for p in group["params"]]
    state: dict[Any, dict[str, Any]] = {}
    for idx, entry in sd["state"].items():
        if int(idx) >= len(params):
            raise ValueError(
                f"{where}: optimizer state for parameter {idx} but this draft trains {len(params)} "
                "tensors; the checkpoint belongs to another draft shape (resume: false, or its "
                "shape)"
            )
        p = params[int(idx)]
        state[idx] = {
            name: _shard_like(value, p, f"{where}: parameter {idx} {name}")
            for name, value in entry.items()
        }
    opt.load_state_dict({**sd, "state": state})


def _shard_like(value: Any, param: torch.Tensor, what: str) -> Any:
    if not torch.is_tensor(value) or value.dim() == 0:  # AdamW's step counter
        return value
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"{what}: shape {tuple(value.shape)} but the parameter is {tuple(param.shape)}; the "
            "checkpoint belongs to another draft shape (resume: false, or train that shape)"
        )
    if hasattr(param, "device_mesh") and not hasattr(value, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = value.to(param.device_mesh.device_type)
        return distribute_tensor(
            local, param.device_mesh, param.placements, src_data_rank=None
        )  # no communication
    return value


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    if d.world > 1:
        dist.all_reduce(t)
    return t


def all_gather_objects(obj, d: Dist) -> list:
    """Every rank's picklable `obj`, in rank order ([obj] in one process)."""
    if d.world == 1:
        return [obj]
    out = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def teardown(d: Dist) -> None:
    """Destroy the process group setup() created (a group the caller made is the caller's: after a
    destroy, a second init in the same torchrun launch hangs on gloo)."""
    if d.owns_group and dist.is_initialized():
        dist.destroy_process_group()
