"""All parallelism in one place: torchrun env -> process group; DDP for small drafts, FSDP2 for large.

Single process (CPU or one GPU) is the no-op case. Data parallelism is by packed row (data.PackedLoader
walks one global order and each rank keeps rows rank::world), so resume is identical for any world size
that divides the rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

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
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(int(os.environ.get("RANK", "0")), world, local, dev)


def wrap(model: torch.nn.Module, d: Dist, fsdp: bool = False) -> torch.nn.Module:
    """DDP (default) or FSDP2 `fully_shard` (drafts too large to replicate). No-op for world == 1."""
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
    return DistributedDataParallel(model, device_ids=[d.device] if d.device.type == "cuda" else None,
                                   static_graph=False, find_unused_parameters=False)


def full_state_dict(module: torch.nn.Module, d: Dist) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict; a collective under FSDP, so every rank must call it."""
    if d.world == 1:
        return {k: v.detach().cpu() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(module: torch.nn.Module, sd: dict[str, torch.Tensor], d: Dist) -> None:
    """Load an unsharded state dict (every rank holds it) into a plain, DDP or FSDP2 module; non-strict."""
    if d.world == 1:
        module.load_state_dict(sd, strict=False)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, sd, options=StateDictOptions(full_state_dict=True, strict=False))


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
    if d.world > 1 and dist.is_initialized():
        dist.destroy_process_group()
