#!/usr/bin/env bash
# Run the test suite, all three tiers: tests/unit (in-process), tests/distributed (multi-process runs over
# gloo on CPU) and tests/e2e (through run_train.sh). Installs the project with its [dev] extras into .venv
# on the first run. Extra arguments go to pytest, e.g. ./run_tests.sh tests/unit (the quick loop) or
# ./run_tests.sh -k checkpoint -x
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
ensure_env "[dev]" "pytest transformers torchft" || exit 1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m pytest -q "$@"
