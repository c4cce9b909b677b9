"""Plain (no speculation) vLLM decode speed of a target on this machine: generated tokens/s, in its
own process.

    python benchmarks/decode_speed.py --target T --prompts P [--dtype auto] \
        [--env VLLM_CPU_NUM_OF_RESERVED_CPU=0]

Measured the CPU defaults of eagle3.vllm_engine (dtype float32 without native bf16, vLLM's thread
reservation); prints one `RESULT {json}` line.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from eagle3.vllm_engine import engine_kwargs, run_in_subprocess, setup_cpu_env, shutdown_engine


def decode_benchmark(
    target: str,
    prompts: list[list[int]],
    max_tokens: int,
    env: dict[str, str] | None = None,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """Generated tokens/s of plain greedy decoding (run it through run_in_subprocess)."""
    import time

    for k, v in (env or {}).items():
        os.environ[k] = v
    setup_cpu_env()
    from vllm import LLM, SamplingParams

    kw = engine_kwargs(target, **llm_kwargs)
    t0 = time.time()
    llm = LLM(**kw)
    startup = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(
        [{"prompt_token_ids": prompts[0]}],
        SamplingParams(temperature=0.0, max_tokens=8),
        use_tqdm=False,
    )
    t1 = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    dt = time.time() - t1
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    shutdown_engine(llm)
    return {
        "engine": {k: v for k, v in kw.items() if k not in ("model", "tokenizer")},
        "env": {
            k: v
            for k, v in os.environ.items()
            if k.startswith(("VLLM_CPU", "LD_PRELOAD", "OMP_", "KMP_"))
        },
        "prompts": len(prompts),
        "generated_tokens": gen,
        "seconds": round(dt, 2),
        "tokens_per_s": round(gen / dt, 1),
        "startup_s": round(startup, 1),
        "loadavg_1m": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(
        prog="benchmarks/decode_speed.py", description="plain vLLM decode benchmark"
    )
    p.add_argument("--target", required=True)
    p.add_argument(
        "--prompts", required=True, help="chat data / prompts file (any format eagle3 reads)"
    )
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--compiled", action="store_true", help="no enforce_eager")
    p.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="env for the engine process"
    )
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from eagle3.chat_formats import read_prompts

    tok = AutoTokenizer.from_pretrained(a.target)
    convs = read_prompts(a.prompts, limit=a.num_prompts).conversations
    ids = [
        list(
            tok.apply_chat_template(
                c.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for c in convs
    ]
    env = dict(kv.split("=", 1) for kv in a.env)
    res = run_in_subprocess(
        decode_benchmark,
        a.target,
        ids,
        a.max_tokens,
        env,
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        max_num_seqs=a.max_num_seqs,
        enforce_eager=not a.compiled,
    )
    print("RESULT " + json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
