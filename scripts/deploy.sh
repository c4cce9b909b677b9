#!/usr/bin/env bash
# The deploy step (docs/operations.md): block types, the deployments in prefect.yaml whose work pool
# exists on the server (a deployment on a pool nobody created would show "Not Ready" forever: it is
# skipped, with a line saying how to add it), and the automations eagle3-run-lost (a run without
# heartbeats is set Crashed) and eagle3-run-failed (alerts), against the server in PREFECT_API_URL.
# Alerts go to $EAGLE3_ALERT_WEBHOOK_URL (a webhook) or $EAGLE3_ALERT_BLOCK (any saved notification
# block, <type slug>/<name>); with neither it says so.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${PREFECT_API_URL:?set PREFECT_API_URL to the server, e.g. http://127.0.0.1:4200/api}"
python -m eagle3_prefect.blocks.register
names=$(python -m eagle3_prefect.flows.deploy prefect.yaml)
args=()
while IFS= read -r name; do args+=(--name "$name"); done <<< "$names"
EAGLE3_REPO_DIR=${EAGLE3_REPO_DIR:-$PWD} prefect --no-prompt deploy "${args[@]}"
python -m eagle3_prefect.blocks.alerts
