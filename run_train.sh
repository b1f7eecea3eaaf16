#!/usr/bin/env bash
# Train with torchrun. Usage:
#   ./run_train.sh                                   # debug model on the bundled corpus
#   CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --training.steps 100
# Environment: NGPU (processes per node; default: GPUs present, else 1), NNODES, NODE_RANK,
# RDZV_ENDPOINT (host:port) or MASTER_ADDR/MASTER_PORT, LOG_RANK (ranks whose console output is shown),
# MAX_RESTARTS (torchrun restarts after a failure). Under Slurm or PBS these are derived from the
# scheduler's variables (see scripts/launch_env.sh).
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)

# First run on a fresh clone: create .venv and install the project into it.
source "$ROOT/scripts/setup_env.sh"
ensure_env "" "" || exit 1

CONFIG_FILE=${CONFIG_FILE:-"$ROOT/train_configs/debug_model.toml"}
if [ -z "${NGPU:-}" ]; then
    NGPU=$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -c GPU || true)
    [ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
fi
# Scheduler variables (Slurm, PBS) fill in NNODES, NODE_RANK and the rendezvous endpoint.
source "$ROOT/scripts/launch_env.sh"
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}

TORCHRUN_ARGS=(--nnodes="$NNODES" --nproc-per-node="$NGPU" --max-restarts="$MAX_RESTARTS"
               --local-ranks-filter="$LOG_RANK" --role=rank)
if [ "$NNODES" -gt 1 ] || [ -n "${RDZV_ENDPOINT:-}" ]; then
    RDZV_ENDPOINT=${RDZV_ENDPOINT:-"${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}"}
    TORCHRUN_ARGS+=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-trainer}"
                    --node-rank="$NODE_RANK")
else
    # One node: a free local port, so several runs can share a machine.
    TORCHRUN_ARGS+=(--standalone)
fi

# Pre-flight: a bad key, type or layout fails here in a fraction of a second, with one clear message.
case " $* " in *" --help "*|*" -h "*) exec "$PYTHON" -m trainer.config --help ;; esac
WORLD_SIZE=$((NGPU * NNODES)) "$PYTHON" -m trainer.config --check --job.config_file "$CONFIG_FILE" "$@" || exit $?

exec "$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" -m trainer.train --job.config_file "$CONFIG_FILE" "$@"
