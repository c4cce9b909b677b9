"""transformers' own routing of a tiny MoE target, as the reference the routing measurement is held
to (tests/test_routing.py, tests/test_kimi_k25.py, benchmarks/vllm_routing.py): each token's
experts in every MoE layer as the model's gates return them, the same recomputed by
eagle3.capture.routing's reference router from the gates' logits, and each token's margin at the
top-k boundary (below a dtype's rounding, two implementations may rightly disagree)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .hf_backend import moe_gates
from .routing import boundary_margin, route_logits, router_spec


def reference_routing(
    model: Any, samples: list[Any], device: str = "cpu"
) -> tuple[list, list, list]:
    """For each sample (token ids [T]), one forward at a time of the loaded transformers `model`
    (float32 for a reference): (the gates' own ids [T, L, K] sorted per token, the reference
    router's ids from the gates' logits [T, L, K] sorted, margins [T, L]), all on the CPU."""
    spec = router_spec(model.config.to_dict())
    gates = moe_gates(model)
    seen: list = []
    hooks = [g.register_forward_hook(lambda m, _a, o: seen.append((m, o))) for _, g in gates]
    own, ref, margins = [], [], []
    try:
        with torch.inference_mode():
            for s in samples:
                seen.clear()
                model(input_ids=torch.as_tensor(s)[None].to(device), use_cache=False)
                bias = [getattr(m, "e_score_correction_bias", None) for m, _ in seen]
                logits = [o[0].detach().float().cpu() for _, o in seen]  # [T, E] per layer
                own.append(torch.stack([o[2].cpu().sort(-1).values for _, o in seen], 1))
                ref.append(
                    torch.stack(
                        [route_logits(x, spec, b) for x, b in zip(logits, bias, strict=True)], 1
                    )
                )
                margins.append(
                    torch.stack(
                        [boundary_margin(x, spec, b) for x, b in zip(logits, bias, strict=True)], 1
                    )
                )
    finally:
        for h in hooks:
            h.remove()
    return own, ref, margins


def compare_routing(
    got: list[np.ndarray], want: list[Any], margins: list[Any], tie: float
) -> dict[str, int]:
    """Token-layers whose expert sets differ between `got` ([T, L, K] per row, any order) and
    `want` ([T, L, K] sorted), how many of those are near-ties (margin below `tie`), of how many."""
    differ = ties = total = 0
    for g, w, m in zip(got, want, margins, strict=True):
        bad = (np.sort(np.asarray(g, dtype=np.int64), -1) != w.numpy()).any(-1)  # [T, L]
        differ += int(bad.sum())
        ties += int((bad & (m.numpy() < tie)).sum())
        total += bad.size
    return {"differ": differ, "near_ties": ties, "token_layers": total}
