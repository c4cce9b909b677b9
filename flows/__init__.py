"""Prefect flows for the eagle3 pipeline: eagle3_pipeline, layer_sweep, retrain and the GPU stage flows."""

import os

# `eagle3 run` starts Prefect's embedded API; its first start (database migrations) can take longer
# than Prefect's 20 s default on a busy 2-core machine. Only a default: the environment wins.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# The embedded API's telemetry heartbeat (on by default) writes its session row into the same SQLite file
# at the moment the flow run is created: under load the two writers collide and the heartbeat dies with
# "sqlite3.OperationalError: database is locked" (a 140-line traceback at every `eagle3 run`), and it
# then posts to prefect.io, which an offline pipeline must not do. Off unless the environment turns it on.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
