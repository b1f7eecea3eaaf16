# Sourced by run_train.sh: derive NNODES, NODE_RANK and the rendezvous endpoint from the scheduler.
# Values already set in the environment win.
if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_NNODES:-}" ]; then
    NNODES=${NNODES:-$SLURM_NNODES}
    NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
    if [ -z "${RDZV_ENDPOINT:-}" ] && [ -z "${MASTER_ADDR:-}" ] && [ -n "${SLURM_JOB_NODELIST:-}" ]; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n 1)
    fi
    RDZV_ID=${RDZV_ID:-$SLURM_JOB_ID}
elif [ -n "${PBS_NODEFILE:-}" ] && [ -f "${PBS_NODEFILE}" ]; then
    NNODES=${NNODES:-$(sort -u "$PBS_NODEFILE" | wc -l)}
    # mpiexec sets one of these per launched process (one per node).
    NODE_RANK=${NODE_RANK:-${PMI_RANK:-${PALS_NODEID:-${OMPI_COMM_WORLD_RANK:-0}}}}
    [ -n "${RDZV_ENDPOINT:-}" ] || [ -n "${MASTER_ADDR:-}" ] || MASTER_ADDR=$(head -n 1 "$PBS_NODEFILE")
    RDZV_ID=${RDZV_ID:-${PBS_JOBID:-trainer}}
fi
