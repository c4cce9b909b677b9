"""Prefect flows for the eagle3 pipeline: eagle3_pipeline, layer_sweep, retrain and the GPU stage
flows."""

import os
import sys

#: Defaults for the Prefect settings of a run; each only where the environment does not set it.
DEFAULT_SETTINGS = {
    # `eagle3 run` starts Prefect's embedded API; its first start (database migrations) can take
    # longer than Prefect's 20 s default on a busy 2-core machine.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    # The embedded API's telemetry heartbeat (on by default) posts to prefect.io: offline it logs
    # "ERROR | prefect.server.services.telemetry - Failed to send telemetry" at every `eagle3 run`,
    # an ERROR where nothing of ours failed; and it writes its session row into the same SQLite
    # file as the flow run being created, which under load dies with "database is locked". The
    # embedded server inherits this process's environment, so off here is off there.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}
# Prefect's flow-run heartbeat every 30 s (its minimum; its default is 180 s): the server's
# automation eagle3-run-lost (blocks/alerts.py) sets a run that misses them for EAGLE3_LOST_AFTER_S
# (60 s) Crashed. Deployments set it in prefect.yaml; this covers runs started from Python
# (`eagle3 run`, a script). Either of the two names set in the environment wins.
_HEARTBEAT_VARS = ("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "PREFECT_RUNNER_HEARTBEAT_FREQUENCY")
if not any(name in os.environ for name in _HEARTBEAT_VARS):
    DEFAULT_SETTINGS["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"
_unset = {name: value for name, value in DEFAULT_SETTINGS.items() if name not in os.environ}
os.environ.update(_unset)
if _unset and "prefect.context" in sys.modules:  # prefect read its settings already: read again
    sys.modules["prefect.context"].refresh_global_settings_context()

from eagle3_prefect.tasks import logs as _logs  # noqa: E402 - after the settings above

_logs.install()  # one ERROR record per config error, its traceback at DEBUG (tasks/logs.py)
