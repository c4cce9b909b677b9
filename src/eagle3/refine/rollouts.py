"""Rollouts: the target's own continuations of prompts at every temperature, generated through
the regenerate stage's generators (eagle3.data.regenerate) and captured by the capture stage at
the draft's captured aux ids, in one dir (rollouts/, captured/, rollouts.json)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from eagle3.artifacts import CaptureManifest, PreparedMeta
from eagle3.capture import CaptureResult, run_capture
from eagle3.config import CaptureConfig, RegenerateConfig
from eagle3.data.regenerate import open_generator, open_renderer
from eagle3.data.rollout import RolloutSettings, data_dirs, generate_rollouts, write_rollouts
from eagle3.io import read_json, write_json
from eagle3.refine.plan import Plan, say
from eagle3.train.data import CapturedDataset, SelectedLayers

ROLLOUT_RECORD = "rollouts.json"


def ensure_rollouts(plan: Plan, where: Path, key: str, prompts: list, seed: int) -> dict[str, Any]:
    """Rollouts of `prompts` at every temperature, captured, in `where` (rollouts/, captured/,
    rollouts.json). Reused when rollouts.json holds `key`; generation is skipped when rollouts/
    holds it (a capture cut short resumes); otherwise `where` is cleared and both run. Returns
    rollouts.json."""
    rec = where / ROLLOUT_RECORD
    if (
        rec.is_file()
        and read_json(rec).get("key") == key
        and (where / "captured" / CaptureManifest.FILE).is_file()
    ):
        return read_json(rec)
    rec.unlink(missing_ok=True)
    made = where / "rollouts" / PreparedMeta.FILE
    if not (made.is_file() and PreparedMeta.read(made).key == key):
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        generate(plan, where, key, prompts, seed)
    stats = PreparedMeta.read(made).stats or {}
    cap = capture(plan, where)
    record = {
        "key": key,
        **stats,
        "num_captured": cap.num_samples,
        "captured_tokens": cap.num_tokens,
        "capture_s": cap.capture_s,
        "capture_skipped": cap.num_skipped,
    }
    write_json(rec, record)
    return record


def generate(plan: Plan, where: Path, key: str, prompts: list, seed: int) -> None:
    """The target's continuations of `prompts` at every temperature, written as a prepared
    dataset in where/rollouts (its meta records `key`)."""
    c = plan.cfg
    regen = RegenerateConfig(
        target=c.target,
        max_new_tokens=c.max_new_tokens,
        top_p=c.top_p,
        seed=seed,
        batch_size=c.generate_batch_size,
        max_model_len=plan.train.loader.max_seq_len,
        backend=plan.backend,
        device=c.device,
        dtype=c.dtype,
        trust_remote_code=c.trust_remote_code,
        chat_template_kwargs=c.chat_template_kwargs,
    )
    gen, engine = open_generator(regen, open_renderer(regen))
    try:
        settings = RolloutSettings(list(c.temperatures), c.top_p, c.max_new_tokens, seed)
        rows, stats = generate_rollouts(gen, prompts, settings, c.generate_batch_size)
    finally:
        gen.close()
    if not rows:
        raise ValueError(
            f"refine: the target wrote nothing for {len(prompts)} prompts "
            f"({stats['finish_reasons']}); check the target and --max-new-tokens"
        )
    sources = [PreparedMeta.load(d) for d in data_dirs(c.data)]
    engine = json.loads(json.dumps(engine, default=str))
    write_rollouts(
        rows,
        where / "rollouts",
        sources,
        {
            "key": key,
            "seed": seed,
            "temperatures": list(c.temperatures),
            "top_p": c.top_p,
            "max_new_tokens": c.max_new_tokens,
            "engine": engine,
            "stats": stats,
        },
    )
    say(
        f"{stats['num_rollouts']} rollouts, {stats['generated_tokens']} tokens in "
        f"{stats['generate_s']} s ({stats['generated_tokens_per_s']} tokens/s) -> {where}"
    )


def capture(plan: Plan, where: Path) -> CaptureResult:
    """The capture stage over where/rollouts into where/captured; returns its result."""
    c = plan.cfg
    return run_capture(
        CaptureConfig(
            target=c.target,
            data=str(where / "rollouts"),
            out=where / "captured",
            aux_layer_ids=plan.captured_aux,
            backend=plan.backend,
            device=c.device,
            dtype=c.dtype,
            storage_dtype=c.storage_dtype,
            batch_tokens=c.capture_batch_tokens,
            trust_remote_code=c.trust_remote_code,
        )
    )


def open_rollouts(plan: Plan, where: Path) -> tuple[Any, list[str]]:
    """(the samples of a captured rollout dir at the draft's aux ids, their sample ids)."""
    raw = CapturedDataset(where / "captured", verify=False)
    samples = SelectedLayers(raw, raw.manifest.aux_layer_ids, plan.aux_layer_ids, plan.num_layers)
    return samples, raw.sample_ids()
