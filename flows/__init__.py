"""Prefect flows for the eagle3 pipeline: eagle3_pipeline, layer_sweep, retrain and the GPU stage flows."""

import os

# `eagle3 run` starts Prefect's embedded API; its first start (database migrations) can take longer
# than Prefect's 20 s default on a busy 2-core machine. Only a default: the environment wins.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
