"""Capture throughput vs plain vLLM prefill of the same prompts, same engine, one run.

    python benchmarks/capture_throughput.py [--num-prompts 1000] [--batch-tokens 8192]

Prompts: the first N GSM8K-train questions of refbench as single user messages through the target's
chat template (with the generation prompt). One vllm.LLM (capture worker extension loaded, engine
settings of eagle3.capture.vllm_backend.engine_kwargs: eager, no prefix caching, chunked prefill,
max_num_batched_tokens = batch_tokens) runs: plain prefill (SamplingParams(max_tokens=1)), then
`run_capture` (states recorded, shards written + hashed), then plain prefill again. The ratio is
capture time / mean plain prefill time. Writes benchmarks/results/capture_throughput.{json,md}.
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
    ap.add_argument("--storage-dtype", default="bfloat16")
    ap.add_argument("--dtype", default="bfloat16", help="engine compute dtype (same for prefill and capture)")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved prefill/capture repetitions (min is reported)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "capture_throughput"))
    ap.add_argument("--workdir", default=None, help="where the prepared data and capture go (default: a temp dir)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3.capture import load_manifest, run_capture
    from eagle3.capture.vllm_backend import EXTENSION, engine_kwargs
    from eagle3.config import CaptureConfig
    from eagle3.data.prepared import save_prepared

    work = Path(args.workdir or tempfile.mkdtemp(prefix="capbench."))
    tok = AutoTokenizer.from_pretrained(args.target)
    rows = []
    with open(args.prompts) as f:
        for i, line in enumerate(f):
            if i >= args.num_prompts:
                break
            q = json.loads(line)["question"]
            ids = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True,
                                          return_dict=False)
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            rows.append({"input_ids": ids, "loss_mask": [0] * len(ids), "sample_id": f"gsm8k-train-{i}"})
    num_tokens = sum(len(r["input_ids"]) for r in rows)
    prep = save_prepared(rows, work / "prepared", {"stage": "prepare", "source": args.prompts})
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

    prefill_runs, capture_runs = [], []
    cap_dir = work / "captured"
    cfg = CaptureConfig(target=args.target, data=str(prep), out=cap_dir, backend="vllm", batch_tokens=args.batch_tokens,
                        dtype=args.dtype, storage_dtype=args.storage_dtype, min_free_disk_gb=0.5)
    for _ in range(args.repeats):  # interleaved, so load changes on the shared box hit both alike
        prefill_runs.append(prefill())
        shutil.rmtree(cap_dir, ignore_errors=True)
        t0 = time.perf_counter()
        res = run_capture(cfg, llm=llm)
        capture_runs.append(time.perf_counter() - t0)
    prefill_runs.append(prefill())
    manifest = load_manifest(cap_dir)
    prefill_s, capture_s = min(prefill_runs), min(capture_runs)
    import torch
    import vllm

    result = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor(),
                    "load_avg_at_end": os.getloadavg()},
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "target": args.target,
        "prompts": f"first {len(rows)} GSM8K-train questions as user messages, chat template + generation prompt",
        "num_prompts": len(rows),
        "num_tokens": num_tokens,
        "engine": {k: v for k, v in kw.items() if k != "model"},
        "layers": manifest["layers"],
        "storage_dtype": args.storage_dtype,
        "bytes_written": res.bytes_written,
        "engine_start_s": round(engine_start_s, 2),
        "dtype": args.dtype,
        "prefill_runs_s": [round(x, 3) for x in prefill_runs],
        "capture_runs_s": [round(x, 3) for x in capture_runs],
        "prefill_s": round(prefill_s, 3),
        "prefill_tokens_per_s": round(num_tokens / prefill_s, 1),
        "capture_s": round(capture_s, 3),
        "capture_tokens_per_s": round(num_tokens / capture_s, 1),
        "ratio_capture_over_prefill": round(capture_s / prefill_s, 3),
        "ratio_of_means": round((sum(capture_runs) / len(capture_runs)) / (sum(prefill_runs) / len(prefill_runs)), 3),
        "goal_ratio": 1.25,
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
        f"load average at end {tuple(round(x, 2) for x in result['machine']['load_avg_at_end'])} "
        "(other engineers' tests ran on the same cores)",
        f"- vLLM {result['versions']['vllm']}, torch {result['versions']['torch']}",
        f"- target: {args.target}; prompts: {result['prompts']} ({num_tokens} tokens)",
        f"- engine (same for both): {json.dumps(result['engine'])}",
        f"- engine dtype {args.dtype}; capture: layers {result['layers']} + last, stored as {args.storage_dtype}, "
        f"{res.bytes_written / 1e6:.1f} MB written",
        "",
        "| run | seconds | tokens/s |",
        "|---|---|---|",
        *[f"| plain prefill #{i + 1} | {x:.2f} | {num_tokens / x:,.0f} |" for i, x in enumerate(prefill_runs)],
        *[f"| capture #{i + 1} (run_capture: record + shards + sha256) | {x:.2f} | {num_tokens / x:,.0f} |"
          for i, x in enumerate(capture_runs)],
        "",
        f"**capture / prefill = {result['ratio_capture_over_prefill']:.2f}** (best capture / best prefill; "
        f"ratio of means {result['ratio_of_means']:.2f}; goal <= 1.25). Runs alternate prefill, capture, ... prefill.",
        "",
    ]
    with atomic_path(out.with_suffix(".md")) as tmp:
        tmp.write_text("\n".join(md))
    print(json.dumps(result, indent=2))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
