#!/usr/bin/env bash
# The test command (README, .ci/run): builds/updates .venv, then runs the whole suite on the CPU
# (two pytest-xdist workers: pyproject's addopts; `bash scripts/test.sh -n 0` runs it serially).
# Other arguments go to pytest.
#
#   bash scripts/test.sh --quick     the unit tests only: no vLLM engine, no Prefect API, nothing
#                                    slow (marks vllm / prefect / slow, some set in conftest.py),
#                                    under 2 minutes on 2 cores; tests/quick_guard stops a test that
#                                    would start an engine or a Prefect API anyway
#   bash scripts/test.sh --dry-run   print the commands instead of running them
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
dry_run=0
pytest_args=()
for arg in "$@"; do
  case $arg in
    --quick) quick=1 ;;
    --dry-run) dry_run=1 ;;
    *) pytest_args+=("$arg") ;;
  esac
done
if [ "$quick" = 1 ]; then
  pytest_args=(-m "not vllm and not slow and not prefect" ${pytest_args[@]+"${pytest_args[@]}"})
  export PYTHONPATH="$PWD/tests/quick_guard${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ "$dry_run" = 1 ]; then
  [ "$quick" = 1 ] && echo "PYTHONPATH=$PYTHONPATH"
  echo ".venv/bin/ruff check src tests flows tasks blocks benchmarks scripts"
  echo ".venv/bin/lint-imports"
  printf '%q ' .venv/bin/python -m pytest ${pytest_args[@]+"${pytest_args[@]}"}
  echo
  exit 0
fi
bash scripts/venv.sh
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check src tests flows tasks blocks benchmarks scripts
# who may import whom, and no import cycle (contracts in pyproject.toml [tool.importlinter];
# docs/architecture.md)
.venv/bin/lint-imports
# PostgreSQL for tests/test_prefect_server.py (it runs a throwaway cluster of its own from the
# Debian package's binaries, SQLite without them): installed here when missing, as root with
# apt-get (CI). EAGLE3_TEST_POSTGRES=0 skips it (the test then uses SQLite).
if [ "$quick" = 0 ] && [ "${EAGLE3_TEST_POSTGRES:-1}" != 0 ] \
    && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  t0=$(date +%s)
  if apt-get update -q >/dev/null \
      && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; then
    echo "[test] installed PostgreSQL in $(( $(date +%s) - t0 )) s" >&2
  else
    echo "[test] could not install PostgreSQL: tests/test_prefect_server.py runs on SQLite" >&2
  fi
fi
exec .venv/bin/python -m pytest ${pytest_args[@]+"${pytest_args[@]}"}
