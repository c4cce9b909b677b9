"""The device a refine run works on, the target's head over the draft vocabulary, and a draft
loaded onto them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3.model.draft import text_config
from eagle3.refine.plan import Plan, read_d2t
from eagle3.train import parallel
from eagle3.train.estimate import load_draft_dir
from eagle3.train.loss import TargetHead
from eagle3.train.step import TTTModule
from eagle3.train.trainer import freeze_parameters
from eagle3.weights import load_target_tensors, read_target_config


@dataclass
class Runtime:
    d: Any  # eagle3.train.parallel.Dist: the device
    amp: torch.dtype  # autocast dtype (float32 on the CPU)
    head: Any  # the target's TargetHead over the draft vocabulary, on the device


def open_runtime(plan: Plan) -> Runtime:
    d = parallel.setup(plan.train.device)
    cuda = d.device.type == "cuda"
    if cuda:  # as the trainer: host work packs small tensors; a full OpenMP team oversubscribes
        torch.set_num_threads(min(torch.get_num_threads(), 4))
    amp = torch.bfloat16 if cuda and plan.train.runtime.dtype == "bfloat16" else torch.float32
    tensors = load_target_tensors(plan.cfg.target)
    eps = text_config(read_target_config(plan.cfg.target)).get("rms_norm_eps", 1e-6)
    d2t = read_d2t(plan.checkpoint)
    head = TargetHead(tensors["norm"], eps, tensors["lm_head"], torch.arange(d2t.numel()) + d2t)
    return Runtime(d, amp, head.to(d.device, amp))


def load_draft(plan: Plan, where: Path, rt: Runtime):
    """(the draft of `where` on the device, a TTTModule around it)."""
    model, _ = load_draft_dir(where, plan.cfg.target)  # its dropout as trained (draft_config)
    freeze_parameters(model, plan.train.draft.freeze)
    model = model.to(rt.d.device)
    return model, TTTModule(model)
