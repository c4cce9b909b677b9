"""Prefect flows for the eagle3 pipeline: eagle3_pipeline, layer_sweep, retrain and the GPU stage
flows."""

import os
import sys

# `eagle3 run` starts Prefect's embedded API; its first start (database migrations) can take longer
# than Prefect's 20 s default on a busy 2-core machine. Only a default: the environment wins.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# The embedded API's telemetry heartbeat (on by default) writes its session row into the same SQLite
# file at the moment the flow run is created: under load the two writers collide and the heartbeat
# dies with "sqlite3.OperationalError: database is locked" (a 140-line traceback at every `eagle3
# run`), and it then posts to prefect.io, which an offline pipeline must not do. Off unless the
# environment turns it on.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# Prefect's flow-run heartbeat every 30 s (its minimum; its default is 180 s): the server's
# automation eagle3-run-lost (blocks/alerts.py) sets a run that misses them for EAGLE3_LOST_AFTER_S
# (60 s) Crashed. Deployments set it in prefect.yaml; this covers runs started from Python
# (`eagle3 run`, a script). Only a default.
_HEARTBEAT_VARS = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")
if not any(name in os.environ for name in _HEARTBEAT_VARS):
    os.environ["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"
    if "prefect.context" in sys.modules:  # prefect read its settings already: read them again
        sys.modules["prefect.context"].refresh_global_settings_context()

from eagle3_prefect.tasks import logs as _logs  # noqa: E402 - after the settings above

_logs.install()  # one ERROR record per config error, its traceback at DEBUG (tasks/logs.py)
