"""Scheduled retraining: run the pipeline on the data as it is now, and promote the new draft only
if it evaluates better than the current one.

Each (data content, config) pair gets its own candidate directory under
<work_dir>/candidates/<data sha>-<config sha>, so an unchanged dataset re-uses every cached stage
(and the current draft is never overwritten by a candidate). The gate compares τ on the same eval
prompts; <work_dir>/current.json records which draft is current (and the one before),
<work_dir>/current-draft is a symlink to it, and <work_dir>/drafts.jsonl logs every decision.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from eagle3.config import ConfigError, PipelineConfig
from eagle3_prefect.flows.dispatch import Dispatch, absolute_config
from eagle3_prefect.flows.pipeline import eagle3_pipeline
from eagle3_prefect.flows.report import run_namer
from eagle3_prefect.flows.runlock import work_dir_lock
from eagle3_prefect.tasks.artifacts import artifact_key, find_tau
from eagle3_prefect.tasks.manifest import fingerprint_path, sha256_json

CURRENT = "current.json"
HISTORY = "drafts.jsonl"
LINK = "current-draft"


def candidate_config(config: PipelineConfig) -> PipelineConfig:
    """The config of this data version's candidate run (own work dir, same target and eval
    prompts)."""
    data_sha = fingerprint_path(config.data)[:12]
    conf_sha = sha256_json(config.model_dump(mode="json", exclude={"work_dir"}))[:8]
    c = config.model_copy(deep=True)
    c.work_dir = config.work_dir / "candidates" / f"{data_sha}-{conf_sha}"
    return c


def read_current(work_dir: Path) -> dict[str, Any] | None:
    p = work_dir / CURRENT
    return json.loads(p.read_text()) if p.is_file() else None


def gate(new_tau: float, current: dict[str, Any] | None, min_tau_gain: float) -> tuple[bool, str]:
    """(promote?, why). The first draft is always promoted; a missing current draft is replaced."""
    if current is None:
        return True, "no current draft"
    if not Path(current["draft"]).is_dir():
        return True, f"current draft {current['draft']} is gone"
    old = current.get("tau")
    if old is None:
        return True, "current draft has no τ"
    if new_tau > old + min_tau_gain:
        return True, f"τ {new_tau:.3f} > {old:.3f} + {min_tau_gain}"
    return (
        False,
        f"τ {new_tau:.3f} does not beat the current {old:.3f} + {min_tau_gain}: keeping the "
        "current draft",
    )


def promote(work_dir: Path, record: dict[str, Any], previous: dict[str, Any] | None) -> None:
    """Write current.json and re-point the current-draft symlink, each atomically."""
    work_dir.mkdir(parents=True, exist_ok=True)
    tmp = work_dir / f".{CURRENT}.tmp"
    tmp.write_text(
        json.dumps(
            {
                **record,
                "previous": previous and {k: v for k, v in previous.items() if k != "previous"},
            },
            indent=2,
        )
    )
    os.replace(tmp, work_dir / CURRENT)
    link_tmp = work_dir / f".{LINK}.tmp"
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(Path(record["draft"]).resolve(), target_is_directory=True)
    os.replace(link_tmp, work_dir / LINK)


@flow(name="eagle3-retrain", log_prints=True, flow_run_name=run_namer("retrain"))
def retrain(
    config: PipelineConfig, min_tau_gain: float = 0.0, dispatch: Dispatch = "auto"
) -> dict[str, Any]:
    """Run the pipeline on the current data; promote its draft only when τ beats the current
    draft's. Returns {"promoted", "reason", "current", "candidate"}."""
    if not config.eval_prompts:
        raise ConfigError(
            "retrain: eval_prompts is not set; the promotion gate compares τ on held-out prompts, "
            "so set `eval_prompts:` to a prompts .jsonl"
        )
    config = absolute_config(config)
    # one retrain (or pipeline) per work dir
    with work_dir_lock(config.work_dir, "retrain work_dir"):
        return retrain_locked(config, min_tau_gain, dispatch)


def retrain_locked(
    config: PipelineConfig, min_tau_gain: float, dispatch: Dispatch
) -> dict[str, Any]:
    log = get_run_logger()
    cand = candidate_config(config)
    manifests = eagle3_pipeline(cand, dispatch=dispatch)
    new_tau = find_tau(manifests["evaluate"]["result"] or {})
    if new_tau is None:
        raise ValueError(f"retrain: evaluate result has no τ: {manifests['evaluate']['result']}")
    work_dir = config.work_dir
    current = read_current(work_dir)
    record = {
        "draft": manifests["export"]["out"],
        "tau": new_tau,
        "data": config.data,
        "data_sha256": fingerprint_path(config.data),
        "eval_prompts": config.eval_prompts,
        "draft_content_sha256": manifests["export"]["content_sha256"],
        "flow_run_id": str(flow_run.id) if flow_run.id else None,
        "decided_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if current and current.get("draft_content_sha256") == record["draft_content_sha256"]:
        promoted, reason = False, "unchanged: the candidate is the current draft"
    else:
        promoted, reason = gate(new_tau, current, min_tau_gain)
    if promoted:
        promote(work_dir, record, current)
    with open(work_dir / HISTORY, "a") as f:
        f.write(json.dumps({**record, "promoted": promoted, "reason": reason}) + "\n")
    now = read_current(work_dir)
    log.info(
        "retrain %s: %s (%s); current draft %s",
        config.name,
        "promoted" if promoted else "kept",
        reason,
        now and now["draft"],
    )
    create_markdown_artifact(
        markdown=(
            f"# retrain {config.name}: "
            f"{'promoted' if promoted else 'kept current draft'}\n\n{reason}\n\n"
            f"| | draft | τ |\n|---|---|---|\n| candidate | `{record['draft']}` | {new_tau:.3f} |\n"
            f"| current (after) | `{now and now['draft']}` | {now and now['tau']} |\n"
        ),
        key=artifact_key(config.name, "retrain"),
        description="retraining gate decision",
    )
    return {"promoted": promoted, "reason": reason, "current": now, "candidate": record}
