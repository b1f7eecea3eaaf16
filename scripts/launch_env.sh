# Sourced by run_train.sh: derive NNODES, NODE_RANK and the rendezvous endpoint from the scheduler.
# Values already set in the environment win. The scheduler must start ONE run_train.sh per node (torchrun
# then starts NGPU processes on it): `srun --ntasks-per-node=1` under Slurm, `mpiexec -n NNODES --ppn 1`
# (or `--map-by ppr:1:node` with Open MPI) under PBS. See scripts/slurm/train.sbatch, scripts/pbs/train.pbs.
_launch_env_one_per_node() {  # $1: launcher processes, $2: nodes, $3: how to launch one per node
    if [ -n "$1" ] && [ -n "$2" ] && [ "$1" -gt "$2" ] 2>/dev/null; then
        echo "run_train.sh: $1 copies launched on $2 node(s); start exactly one per node ($3)" >&2
        exit 2
    fi
}
if [ -n "${SLURM_JOB_ID:-}" ] && [ -n "${SLURM_NNODES:-}" ]; then
    # Inside `srun` the step's variables describe the nodes this launch runs on.
    _launch_env_one_per_node "${SLURM_STEP_NUM_TASKS:-}" "${SLURM_STEP_NUM_NODES:-}" "srun --ntasks-per-node=1"
    NNODES=${NNODES:-${SLURM_STEP_NUM_NODES:-$SLURM_NNODES}}
    NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
    _nodelist=${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-}}
    if [ -z "${RDZV_ENDPOINT:-}" ] && [ -z "${MASTER_ADDR:-}" ] && [ -n "$_nodelist" ]; then
        # The first node of the list (node rank 0) hosts the rendezvous.
        # (awk reads all of scontrol's output: `head` could kill it with SIGPIPE, fatal under pipefail.)
        MASTER_ADDR=$( { scontrol show hostnames "$_nodelist" 2>/dev/null || true; } | awk 'NR == 1')
        # Without scontrol, a list with no ranges still names its first host.
        case "$_nodelist" in *"["*) ;; *) MASTER_ADDR=${MASTER_ADDR:-${_nodelist%%,*}} ;; esac
        [ -n "$MASTER_ADDR" ] || unset MASTER_ADDR
    fi
    unset _nodelist
    RDZV_ID=${RDZV_ID:-$SLURM_JOB_ID}
elif [ -n "${PBS_JOBID:-}" ] || [ -n "${PBS_NODEFILE:-}" ]; then
    # PBS_NODEFILE has one line per slot, hosts in order, repeated per slot. It may exist on the first node
    # only: scripts/pbs/train.pbs reads it there and passes NNODES and MASTER_ADDR on through mpiexec.
    if [ -z "${NNODES:-}" ] && [ -f "${PBS_NODEFILE:-}" ]; then
        NNODES=$(awk 'NF && !seen[$1]++' "$PBS_NODEFILE" | wc -l)
    fi
    # mpiexec sets one of these per launched process (one per node).
    _launch_env_one_per_node "${PMI_SIZE:-${OMPI_COMM_WORLD_SIZE:-}}" "${NNODES:-1}" \
        "mpiexec -n ${NNODES:-1} --ppn 1, or --map-by ppr:1:node with Open MPI"
    NODE_RANK=${NODE_RANK:-${PMI_RANK:-${PALS_NODEID:-${OMPI_COMM_WORLD_RANK:-${PMIX_RANK:-0}}}}}
    if [ -z "${RDZV_ENDPOINT:-}" ] && [ -z "${MASTER_ADDR:-}" ] && [ -f "${PBS_NODEFILE:-}" ]; then
        MASTER_ADDR=$(awk 'NF {print $1; exit}' "$PBS_NODEFILE")
    fi
    RDZV_ID=${RDZV_ID:-${PBS_JOBID:-trainer}}
fi
unset -f _launch_env_one_per_node
