#!/usr/bin/env bash
# Run the test suite, all three tiers: tests/unit (in-process), tests/distributed (multi-process runs over
# gloo on CPU) and tests/e2e (through run_train.sh). Installs the project with its [dev] extras into .venv
# on the first run. Extra arguments go to pytest, e.g. ./run_tests.sh tests/unit (the quick loop) or
# ./run_tests.sh -k checkpoint -x. Runs on two pytest workers (TEST_WORKERS=1 for one).
# TORCH_VERSION=2.14.1 ./run_tests.sh ... runs it under that torch release instead of the pinned one, in an
# environment of its own (.venv-torch2.14.1, made on the first such run: a multi-GB download).
set -euo pipefail
cd "$(dirname "$0")"
source scripts/setup_env.sh
ensure_env "[dev]" "pytest xdist transformers megatron torchft" || exit 1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Two pytest workers (TEST_WORKERS), each taking whole files: one core each while tests run in-process, and
# the multi-process runs share the machine. -n N or -p no:xdist on the command line decides instead.
# --no-loadscope-reorder: the files go out in tests/conftest.py's order (the longest first), not xdist's
# default of the files with the most tests first, which left a one-test file of a minute for the end.
workers=(-n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
for a in "$@"; do
    case "$a" in -n|-n*|--numprocesses*|no:xdist) workers=() ;; esac
done
exec "$PYTHON" -m pytest -q "${workers[@]}" "$@"
