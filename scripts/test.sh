#!/usr/bin/env bash
# The test command (README, .ci/run): builds/updates .venv, then runs the whole suite on the CPU (two pytest-xdist
# workers: pyproject's addopts; `bash scripts/test.sh -n 0` runs it serially).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check src tests flows tasks blocks benchmarks scripts
# who may import whom, and no import cycle (contracts in pyproject.toml [tool.importlinter]; docs/architecture.md)
.venv/bin/lint-imports
# PostgreSQL for tests/test_prefect_server.py (it runs a throwaway cluster of its own from the Debian package's
# binaries, SQLite without them): installed here when missing, as root with apt-get (CI). EAGLE3_TEST_POSTGRES=0
# skips it (the test then uses SQLite).
if [ "${EAGLE3_TEST_POSTGRES:-1}" != 0 ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  t0=$(date +%s)
  if apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; then
    echo "[test] installed PostgreSQL in $(( $(date +%s) - t0 )) s" >&2
  else
    echo "[test] could not install PostgreSQL: tests/test_prefect_server.py runs on SQLite" >&2
  fi
fi
exec .venv/bin/python -m pytest "$@"
