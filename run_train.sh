#!/usr/bin/env bash
# Train with torchrun. Usage:
#   ./run_train.sh                                   # debug model on the bundled corpus
#   CONFIG_FILE=train_configs/llama3_8b.toml ./run_train.sh --training.steps 100
# Environment: NGPU (processes per node; default: GPUs present, else 1), NNODES, NODE_RANK,
# RDZV_ENDPOINT (host:port) or MASTER_ADDR/MASTER_PORT, LOG_RANK (ranks whose console output is shown),
# MAX_RESTARTS (torchrun restarts after a failure). Under Slurm or PBS these are derived from the
# scheduler's variables (see scripts/launch_env.sh). Multi-node extras: RDZV_ID (job id shared by all
# nodes), RDZV_CONF (torchrun --rdzv-conf, e.g. join_timeout=900), LOCAL_ADDR (this node's address as
# the other nodes reach it). RUN_TRAIN_DRY=1 prints the torchrun command instead of running it. A worker's
# failure prints one line and exits with its code (2 config, 3 checkpoint, 4 data); torchrun's full report
# is in <dump_folder>/launcher/<host>.log.
# See docs/multinode.md.
# Relative paths (CONFIG_FILE, --job.config_file, dump folder, data, tokenizer) are the caller's: resolved
# against the working directory this script is started from, as any command's arguments are.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)

# First run on a fresh clone: create .venv and install the project into it (not for a dry run).
source "$ROOT/scripts/setup_env.sh"
if [ -n "${RUN_TRAIN_DRY:-}" ]; then
    PYTHON=${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3 )}
else
    ensure_env "" "" || exit 1
fi

CONFIG_FILE=${CONFIG_FILE:-"$ROOT/train_configs/debug_model.toml"}
if [ -z "${NGPU:-}" ]; then
    NGPU=$(command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -c GPU || true)
    [ "${NGPU:-0}" -ge 1 ] 2>/dev/null || NGPU=1
fi
if ! [[ "$NGPU" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_train.sh: NGPU=$NGPU must be a positive whole number (processes per node)" >&2
    exit 2
fi
# Scheduler variables (Slurm, PBS) fill in NNODES, NODE_RANK and the rendezvous endpoint.
source "$ROOT/scripts/launch_env.sh"
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
LOG_RANK=${LOG_RANK:-0}
MAX_RESTARTS=${MAX_RESTARTS:-0}

if ! [[ "$NNODES" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_train.sh: NNODES=$NNODES must be a positive whole number (nodes in the job)" >&2
    exit 2
fi
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || [ "$NODE_RANK" -ge "$NNODES" ]; then
    echo "run_train.sh: NODE_RANK=$NODE_RANK must be in [0, NNODES=$NNODES)" >&2
    exit 2
fi
if ! [[ "$LOG_RANK" =~ ^[0-9]+(,[0-9]+)*$ ]]; then
    echo "run_train.sh: LOG_RANK=$LOG_RANK must be local ranks whose output to show, e.g. 0 or 0,1" >&2
    exit 2
fi

TORCHRUN_ARGS=(--nnodes="$NNODES" --nproc-per-node="$NGPU" --max-restarts="$MAX_RESTARTS"
               --local-ranks-filter="$LOG_RANK" --role=rank)
if [ "$NNODES" -gt 1 ] || [ -n "${RDZV_ENDPOINT:-}" ]; then
    if [ -z "${RDZV_ENDPOINT:-}" ] && [ -z "${MASTER_ADDR:-}" ]; then
        echo "run_train.sh: NNODES=$NNODES needs the rendezvous host: set RDZV_ENDPOINT=host:port (or" \
             "MASTER_ADDR and MASTER_PORT) to a node every node can reach, usually node 0" >&2
        exit 2
    fi
    RDZV_ENDPOINT=${RDZV_ENDPOINT:-"${MASTER_ADDR}:${MASTER_PORT:-29500}"}
    # c10d rendezvous: the agent on the endpoint's host serves it; all nodes must use the same id.
    # (torchrun assigns node ranks at the rendezvous; --node-rank is informational with c10d.)
    TORCHRUN_ARGS+=(--rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT" --rdzv-id="${RDZV_ID:-trainer}"
                    --node-rank="$NODE_RANK")
    if [ -n "${LOCAL_ADDR:-}" ]; then
        TORCHRUN_ARGS+=(--local-addr="$LOCAL_ADDR")
        # torchrun recognises the rendezvous host by its hostname; an endpoint on another interface of
        # this node (LOCAL_ADDR) is not recognised, so say so explicitly.
        case ",${RDZV_CONF:-}," in *,is_host=*) ;; *)
            [ "${RDZV_ENDPOINT%:*}" != "$LOCAL_ADDR" ] || RDZV_CONF=${RDZV_CONF:+$RDZV_CONF,}is_host=1 ;;
        esac
    fi
    [ -z "${RDZV_CONF:-}" ] || TORCHRUN_ARGS+=(--rdzv-conf="$RDZV_CONF")
else
    # One node: a free local port, so several runs can share a machine.
    TORCHRUN_ARGS+=(--standalone)
fi

# Preemption (SIGTERM from Slurm/PBS, Ctrl-C): torchrun forwards the signal to the workers, which finish
# their step, save a checkpoint and exit (128 + signal); torchrun kills workers still running after this
# many seconds. Ask the scheduler for the signal earlier than that before its kill (#SBATCH --signal=TERM@120).
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}

# Restarts: with torchrun's c10d rendezvous sharing its store with the workers (the default), a restarted
# attempt can read the previous attempt's connection keys and fail to connect (pytorch/pytorch#135712);
# a fresh store per attempt avoids that.
if [ "$MAX_RESTARTS" -gt 0 ]; then
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
fi

# trainer.launch is torch.distributed.run (the same options) whose failure report is one line and the
# failed worker's exit code (2 config, 3 checkpoint, 4 data), with torchrun's report in the dump folder.
CMD=("$PYTHON" -m trainer.launch "${TORCHRUN_ARGS[@]}" -m trainer.train --job.config_file "$CONFIG_FILE" "$@")
if [ -n "${RUN_TRAIN_DRY:-}" ]; then
    # The command this node would run, shell-quoted on one line; nothing is started.
    [ -z "${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-}" ] || printf 'TORCH_DISABLE_SHARE_RDZV_TCP_STORE=%q ' "$TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    printf '%q ' "${CMD[@]}"
    echo
    exit 0
fi

# Pre-flight: a bad key, type or layout fails here in a fraction of a second, with one clear message.
case " $* " in *" --help "*|*" -h "*) exec "$PYTHON" -m trainer.config --help ;; esac
WORLD_SIZE=$((NGPU * NNODES)) "$PYTHON" -m trainer.config --check --job.config_file "$CONFIG_FILE" "$@" || exit $?

exec "${CMD[@]}"
