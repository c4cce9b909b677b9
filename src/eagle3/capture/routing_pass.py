"""The capture's routing measurement: a bounded, seeded sample of the prepared rows through the
target once more, its expert ids recorded (each backend's `route`), counted
(eagle3.capture.routing) and written beside the shards:

    <out>/routing.json      eagle3.artifacts.RoutingStats (the distinct experts per window)
    <out>/routing_ids.npz   ids [M, L, K] int16, offsets [N+1], rows [N] (prepared row numbers),
                            loss_mask [M], moe_layer_ids [L]

The pass runs once per capture directory, right after the backend starts (before the first shard:
it costs one forward of `capture.routing_sample_rows` rows), and again only when routing.json was
made with other settings; the manifest records the file (`CaptureManifest.routing`). A dense
target, or `routing_sample_rows: 0`, measures nothing and writes nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from eagle3.artifacts import RoutingStats
from eagle3.config import CaptureConfig
from eagle3.io import atomic_path, read_json, sha256_file, write_json
from eagle3.vllm_support import UnsupportedVLLMError

from .chunks import chunk_end
from .routing import RouterSpec, distinct_experts, router_spec, uniform_table

#: the rows' sample and the windows' draws are seeded with this
SEED = 0
#: draws of windows per (t, b) cell
NUM_DRAWS = 256


def wanted_spec(cfg: CaptureConfig) -> RouterSpec | None:
    """The target's router when the capture should measure its routing (routing_sample_rows > 0
    and an MoE target whose router the measurement knows); None otherwise, saying why for an MoE
    target it cannot measure (the capture goes on: the cost model then uses the uniform bound)."""
    if cfg.routing_sample_rows == 0:
        return None
    try:
        return router_spec(read_json(Path(cfg.target) / "config.json"))
    except ValueError as e:
        _say(f"{e}; the routing is not measured")
        return None


def sample_rows(lengths: np.ndarray, length_limit: int | None, num_rows: int) -> np.ndarray:
    """At most `num_rows` prepared rows, drawn without replacement (seed SEED) among those the
    capture runs (not empty, shorter than `length_limit`); ascending. lengths [n] -> rows [<= n]."""
    ok = np.flatnonzero((lengths > 0) & (lengths < (length_limit or np.iinfo(np.int64).max)))
    if len(ok) <= num_rows:
        return ok
    return np.sort(np.random.default_rng(SEED).choice(ok, num_rows, replace=False))


def is_current(out: Path, cfg: CaptureConfig, config_hash: str) -> bool:
    """Does `out` hold routing measured by this capture's settings (config hash, rows, backend)?"""
    try:
        have = RoutingStats.load(out)
    except (ValueError, OSError):
        return False
    if have is None or not (out / RoutingStats.IDS_FILE).is_file():
        return False
    extra = have.model_extra or {}
    return (
        extra.get("config_hash") == config_hash
        and extra.get("routing_sample_rows") == cfg.routing_sample_rows
        and have.backend == cfg.backend
    )


def measure_routing(
    cfg: CaptureConfig, ci: Any, out: Path, backend: Any, config_hash: str
) -> dict[str, Any] | None:
    """Run the routing pass with the started `backend` unless `out` already holds it; returns the
    manifest's entry (`manifest_entry`), None when nothing is measured. `ci`:
    eagle3.capture.inputs.CaptureInputs."""
    spec = wanted_spec(cfg)
    if spec is None:
        return None
    if is_current(out, cfg, config_hash):
        return manifest_entry(out)
    rows = sample_rows(ci.lengths, ci.length_limit, cfg.routing_sample_rows)
    if len(rows) == 0:
        _say(f"routing: no prepared row to route in {cfg.data}; routing not measured")
        return None
    picked = ci.ds[[int(i) for i in rows]]
    samples = [np.asarray(x, dtype=np.int64) for x in picked["input_ids"]]
    masks = [np.asarray(x).astype(bool) for x in picked["loss_mask"]]
    try:
        routed = _route(backend, samples, max(cfg.batch_tokens, 16384))
    except UnsupportedVLLMError as e:  # an engine whose MoE kernels route inside themselves
        _say(f"{e}; the routing is not measured, the capture goes on")
        return None
    _check_shape(routed, samples, spec)
    ids = np.concatenate(routed.ids)  # [M, L, K]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in samples])])  # [N+1]
    counted = distinct_experts(ids, offsets, masks, routed.moe_layer_ids, NUM_DRAWS, SEED)
    with atomic_path(out / RoutingStats.IDS_FILE) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(
                f,
                ids=ids,
                offsets=offsets,
                rows=rows,
                loss_mask=np.concatenate(masks),
                moe_layer_ids=np.asarray(routed.moe_layer_ids),
            )
    stats = {
        "schema": RoutingStats.SCHEMA,
        "num_experts": spec.num_experts,
        "top_k": spec.top_k,
        "moe_layer_ids": routed.moe_layer_ids,
        "num_rows": len(rows),
        "num_tokens": int(offsets[-1]),
        "distinct_experts": {
            "t": counted.t,
            "b": counted.b,
            "mean": counted.mean,
            "per_layer_mean": counted.per_layer_mean,
        },
        "backend": cfg.backend,
        "routing": spec.kind,
        "null_reasons": counted.null_reasons,
        "uniform_mean": uniform_table(spec, counted.t, counted.b),
        "num_draws": counted.num_draws,
        "windows": "consecutive loss-masked (answer) tokens of one row; b windows from b rows",
        "num_groups": spec.num_groups,
        "topk_groups": spec.topk_groups,
        "source": routed.source,
        "rows": [int(r) for r in rows],
        "ids_file": RoutingStats.IDS_FILE,
        "seed": SEED,
        "routing_sample_rows": cfg.routing_sample_rows,
        "config_hash": config_hash,
    }
    RoutingStats.from_dict(stats, str(out / RoutingStats.FILE))  # the consumer's schema holds
    write_json(out / RoutingStats.FILE, stats)
    _say(
        f"routing: {len(rows)} rows / {int(offsets[-1])} tokens routed through "
        f"{len(routed.moe_layer_ids)} MoE layers; {out / RoutingStats.FILE}"
    )
    return manifest_entry(out)


def ensure_routing(
    cfg: CaptureConfig, ci: Any, out: Path, config_hash: str, make_backend: Callable[[], Any]
) -> dict[str, Any] | None:
    """The manifest's routing entry for the capture in `out`, measured now with a backend of its
    own (`make_backend()`, started and closed here) when the capture's own pass did not run (a
    capture over several engines, one finished before the measurement existed, or one resumed with
    nothing left to capture). None when nothing is measured."""
    if wanted_spec(cfg) is None:
        return None
    if is_current(out, cfg, config_hash):
        return manifest_entry(out)
    _say(
        f"routing: measuring the routing of {cfg.routing_sample_rows} rows in an engine of its own"
    )
    backend = make_backend()
    try:
        backend.start()
        return measure_routing(cfg, ci, out, backend, config_hash)
    finally:
        backend.close()


def manifest_entry(out: Path) -> dict[str, Any]:
    """What the capture manifest records of the routing in `out` (CaptureManifest.routing)."""
    stats = RoutingStats.load(out)
    if stats is None:
        raise FileNotFoundError(f"{out / RoutingStats.FILE} does not exist")
    return {
        "file": RoutingStats.FILE,
        "sha256": sha256_file(out / RoutingStats.FILE),
        "ids_file": RoutingStats.IDS_FILE,
        "num_rows": stats.num_rows,
    }


def _route(backend: Any, samples: list[np.ndarray], chunk_tokens: int) -> Any:
    """backend.route over chunks of at most `chunk_tokens` tokens (at least one row), joined."""
    lengths = [len(s) for s in samples]
    order = range(len(samples))
    a, joined = 0, None
    while a < len(samples):
        b = chunk_end(lengths, order, a, chunk_tokens)
        got = backend.route(samples[a:b])
        if joined is None:
            joined = got
        else:
            if got.moe_layer_ids != joined.moe_layer_ids:
                raise RuntimeError(
                    f"routing: the backend's MoE layers changed between chunks "
                    f"({joined.moe_layer_ids} then {got.moe_layer_ids})"
                )
            joined.ids.extend(got.ids)
        a = b
    return joined


def _check_shape(routed: Any, samples: list[np.ndarray], spec: RouterSpec) -> None:
    """RuntimeError naming the row unless every sample has ids [T, L, top_k] within 0..E-1."""
    num_layers = len(routed.moe_layer_ids)
    if num_layers == 0:
        raise RuntimeError(
            "routing: the target's config has routed experts but the backend found no MoE layer "
            "to record; set capture.routing_sample_rows: 0"
        )
    for r, (ids, s) in enumerate(zip(routed.ids, samples, strict=True)):
        if ids.shape != (len(s), num_layers, spec.top_k):
            raise RuntimeError(
                f"routing: sampled row {r} has expert ids of shape {ids.shape}, expected "
                f"{(len(s), num_layers, spec.top_k)} (tokens, MoE layers, top-k)"
            )
        if ids.size and (ids.min() < 0 or ids.max() >= spec.num_experts):
            raise RuntimeError(
                f"routing: sampled row {r} has expert ids outside 0..{spec.num_experts - 1}"
            )


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
