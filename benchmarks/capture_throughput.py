"""Capture throughput vs plain vLLM prefill of the same prompts, same engine, one run.

    python benchmarks/capture_throughput.py [--num-prompts 1000] [--batch-tokens 8192] \
        [--storage-dtype bfloat16,fp8]

Prompts: the first N GSM8K-train questions of refbench as single user messages through the target's
chat template (with the generation prompt). One vllm.LLM (capture worker extension loaded, engine
settings of eagle3.capture.vllm_backend.engine_kwargs: eager, no prefix caching, chunked prefill,
max_num_batched_tokens = batch_tokens) runs: plain prefill (SamplingParams(max_tokens=1)), then
`run_capture` once per storage dtype (states recorded, shards written + hashed), repeated, then
plain prefill again. The ratio is best capture time / best plain prefill time (and the ratio of
means), for the first storage dtype; the others are reported alongside. Writes
benchmarks/results/capture_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFBENCH = ROOT.parent / "shared" / "refbench"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REFBENCH / "target-a-llama"))
    ap.add_argument("--prompts", default=str(REFBENCH / "data" / "gsm8k_train.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument(
        "--storage-dtype",
        default="bfloat16",
        help="comma-separated storage dtypes, each captured once per repeat; the first gives the "
        "ratio",
    )
    ap.add_argument(
        "--dtype", default="bfloat16", help="engine compute dtype (same for prefill and capture)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="interleaved prefill/capture repetitions (min is reported)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "capture_throughput"))
    ap.add_argument(
        "--workdir",
        default=None,
        help="where the prepared data and capture go (default: a temp dir)",
    )
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    load_at_start = os.getloadavg()
    dtypes = args.storage_dtype.split(",")

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3.artifacts import CaptureManifest, PreparedMeta
    from eagle3.capture import run_capture
    from eagle3.capture.vllm_backend import EXTENSION, engine_kwargs
    from eagle3.config import CaptureConfig
    from eagle3.prepared import save_prepared

    work = Path(args.workdir or tempfile.mkdtemp(prefix="capbench."))
    tok = AutoTokenizer.from_pretrained(args.target)
    rows = []
    with open(args.prompts) as f:
        for i, line in enumerate(f):
            if i >= args.num_prompts:
                break
            q = json.loads(line)["question"]
            ids = tok.apply_chat_template(
                [{"role": "user", "content": q}],
                tokenize=True,
                add_generation_prompt=True,
                return_dict=False,
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            rows.append(
                {"input_ids": ids, "loss_mask": [0] * len(ids), "sample_id": f"gsm8k-train-{i}"}
            )
    num_tokens = sum(len(r["input_ids"]) for r in rows)
    prep = save_prepared(
        rows, work / "prepared", PreparedMeta(stage="prepare", source=args.prompts)
    )
    max_model_len = max(len(r["input_ids"]) for r in rows) + 1

    kw = engine_kwargs(args.target, args.dtype, args.batch_tokens, max_model_len, 1)
    t = time.time()
    llm = LLM(worker_extension_cls=EXTENSION, **kw)
    engine_start_s = time.time() - t
    prompts = [TokensPrompt(prompt_token_ids=r["input_ids"]) for r in rows]
    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    llm.generate(prompts[:16], sp, use_tqdm=False)  # warm-up

    def prefill() -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    prefill_runs: list[float] = []
    runs: dict[str, list[float]] = {d: [] for d in dtypes}
    written: dict[str, int] = {}
    for _ in range(args.repeats):  # interleaved, so load changes on the shared box hit both alike
        prefill_runs.append(prefill())
        for sd in dtypes:
            cap_dir = work / f"captured-{sd}"
            cfg = CaptureConfig(
                target=args.target,
                data=str(prep),
                out=cap_dir,
                backend="vllm",
                batch_tokens=args.batch_tokens,
                dtype=args.dtype,
                storage_dtype=sd,
                min_free_disk_gb=0.5,
            )
            shutil.rmtree(cap_dir, ignore_errors=True)
            t0 = time.perf_counter()
            res = run_capture(cfg, llm=llm)
            runs[sd].append(time.perf_counter() - t0)
            written[sd] = res.bytes_written
    prefill_runs.append(prefill())
    manifest = CaptureManifest.load(work / f"captured-{dtypes[0]}")
    capture_runs = runs[dtypes[0]]
    prefill_s, capture_s = min(prefill_runs), min(capture_runs)
    mean_pre = sum(prefill_runs) / len(prefill_runs)
    per_dtype = {
        sd: {
            "capture_runs_s": [round(x, 3) for x in r],
            "capture_s": round(min(r), 3),
            "capture_tokens_per_s": round(num_tokens / min(r), 1),
            "ratio_capture_over_prefill": round(min(r) / prefill_s, 3),
            "ratio_of_means": round((sum(r) / len(r)) / mean_pre, 3),
            "bytes_written": written[sd],
            "bytes_per_token": CaptureManifest.load(work / f"captured-{sd}").bytes_per_token,
        }
        for sd, r in runs.items()
    }
    import torch
    import vllm

    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor(),
            "load_avg_at_start": load_at_start,
            "load_avg_at_end": os.getloadavg(),
        },
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "target": args.target,
        "prompts": f"first {len(rows)} GSM8K-train questions as user messages, chat template + "
        "generation prompt",
        "num_prompts": len(rows),
        "num_tokens": num_tokens,
        "engine": {k: v for k, v in kw.items() if k != "model"},
        "aux_layer_ids": manifest.aux_layer_ids,
        "storage_dtype": dtypes[0],
        "bytes_written": written[dtypes[0]],
        "engine_start_s": round(engine_start_s, 2),
        "dtype": args.dtype,
        "prefill_runs_s": [round(x, 3) for x in prefill_runs],
        "capture_runs_s": [round(x, 3) for x in capture_runs],
        "prefill_s": round(prefill_s, 3),
        "prefill_tokens_per_s": round(num_tokens / prefill_s, 1),
        "capture_s": round(capture_s, 3),
        "capture_tokens_per_s": round(num_tokens / capture_s, 1),
        "ratio_capture_over_prefill": round(capture_s / prefill_s, 3),
        "ratio_of_means": round((sum(capture_runs) / len(capture_runs)) / mean_pre, 3),
        "goal_ratio": 1.25,
        "per_storage_dtype": per_dtype,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    from eagle3.io import atomic_path, write_json

    write_json(out.with_suffix(".json"), result)
    md = [
        "# Capture throughput vs plain vLLM prefill",
        "",
        f"- date: {result['date']}",
        f"- command: `{result['command']}`",
        f"- machine: {result['machine']['cpu_count']} CPU cores, {result['machine']['platform']}; "
        f"load average at start {tuple(round(x, 2) for x in load_at_start)}, at end "
        f"{tuple(round(x, 2) for x in result['machine']['load_avg_at_end'])} "
        "(other engineers' tests ran on the same cores)",
        f"- vLLM {result['versions']['vllm']}, torch {result['versions']['torch']}",
        f"- target: {args.target}; prompts: {result['prompts']} ({num_tokens} tokens)",
        f"- engine (same for both): {json.dumps(result['engine'])}",
        f"- engine dtype {args.dtype}; capture: layers {result['layers']} + last, stored as "
        + ", ".join(
            f"{sd} ({written[sd] / 1e6:.1f} MB, {per_dtype[sd]['bytes_per_token']} bytes/token)"
            for sd in dtypes
        ),
        "",
        "| run | seconds | tokens/s |",
        "|---|---|---|",
        *[
            f"| plain prefill #{i + 1} | {x:.2f} | {num_tokens / x:,.0f} |"
            for i, x in enumerate(prefill_runs)
        ],
        *[
            f"| capture {sd} #{i + 1} (run_capture: record + shards + sha256) | {x:.2f} | "
            f"{num_tokens / x:,.0f} |"
            for sd in dtypes
            for i, x in enumerate(runs[sd])
        ],
        "",
        f"**capture / prefill = {result['ratio_capture_over_prefill']:.2f}** ({dtypes[0]} storage; "
        f"best capture / best prefill; ratio of means {result['ratio_of_means']:.2f}; goal <= "
        f"1.25). Runs alternate prefill, capture ({', '.join(dtypes)}), ... prefill.",
        *[
            f"- {sd}: best/best {per_dtype[sd]['ratio_capture_over_prefill']:.2f}, ratio of means "
            f"{per_dtype[sd]['ratio_of_means']:.2f}, {per_dtype[sd]['capture_tokens_per_s']:,.0f} "
            "tokens/s"
            for sd in dtypes
        ],
        "",
    ]
    with atomic_path(out.with_suffix(".md")) as tmp:
        tmp.write_text("\n".join(md))
    print(json.dumps(result, indent=2))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
