"""The parameters file of a pipeline run from a config YAML: `{"config": {...}}`, the whole
pipeline config as JSON, checked (a bad field fails here, naming it), for

    python -m eagle3_prefect.flows.params configs/demo.yaml > my-params.json
    prefect deployment run eagle3-pipeline/pipeline --params "$(cat my-params.json)"

Relative paths stay relative: the flow resolves them in the worker's working directory (the repo
checkout prefect.yaml's pull step names).
"""

from __future__ import annotations

import json
import sys

from eagle3.config import ConfigError, load_pipeline_config


def pipeline_params(config_path: str) -> dict:
    return {"config": load_pipeline_config(config_path).model_dump(mode="json")}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print(
            "usage: python -m eagle3_prefect.flows.params CONFIG.yaml > my-params.json",
            file=sys.stderr,
        )
        return 2
    try:
        params = pipeline_params(args[0])
    except (ConfigError, OSError, ValueError) as e:
        print(f"eagle3 params: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(params, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
