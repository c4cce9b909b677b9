"""Which deployments of prefect.yaml scripts/deploy.sh registers: those whose work pool is on the
server. A deployment on a pool nobody created (gpu-8x on a one-GPU host) would sit "Not Ready" in
the UI forever; it is skipped, with a line saying how to add it (create the pool, run deploy.sh
again).

    python -m eagle3_prefect.flows.deploy prefect.yaml     # one deployment name per line
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml


def deployments_by_pool(prefect_yaml: str | Path) -> dict[str, list[str]]:
    """{work pool: [deployment names]} in prefect.yaml's order."""
    doc: dict[str, Any] = yaml.safe_load(Path(prefect_yaml).read_text())
    found: dict[str, list[str]] = {}
    for d in doc.get("deployments") or []:
        found.setdefault(d["work_pool"]["name"], []).append(d["name"])
    return found


def split_by_pools(
    prefect_yaml: str | Path, pools: set[str]
) -> tuple[list[str], dict[str, list[str]]]:
    """(names of the deployments whose pool is in `pools`, {missing pool: its deployments})."""
    names: list[str] = []
    skipped: dict[str, list[str]] = {}
    for pool, deps in deployments_by_pool(prefect_yaml).items():
        if pool in pools:
            names += deps
        else:
            skipped[pool] = deps
    return names, skipped


def server_pools() -> set[str]:
    """The work pools on the server PREFECT_API_URL names."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {p.name for p in client.read_work_pools()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    prefect_yaml = Path(args[0] if args else "prefect.yaml")
    names, skipped = split_by_pools(prefect_yaml, server_pools())
    for pool, deps in skipped.items():
        print(
            f"deploy: skipping {len(deps)} deployment(s) on work pool {pool!r} ({', '.join(deps)}):"
            f" the server has no such pool. To add them: prefect work-pool create {pool} --type "
            "process, start a worker on it, and run scripts/deploy.sh again",
            file=sys.stderr,
        )
    if not names:
        print(
            f"deploy: none of the work pools of {prefect_yaml} ({', '.join(skipped)}) is on the "
            "server; create them first (docs/operations.md, section 2)",
            file=sys.stderr,
        )
        return 2
    print("\n".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
