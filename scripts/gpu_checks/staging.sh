#!/usr/bin/env bash
# On one CUDA GPU (about 2 minutes; torch and numpy only, no network): a background checkpoint save's copy of
# ~3.6 GB of CUDA tensors with a fresh CPU copy per save (checkpoint.async_mode async) against pinned buffers
# reused from save to save (async_with_pinned_mem), timed alternately in one process through the trainer's
# own staging classes (trainer bench staging), then the CUDA case of the test that each reused-buffer save
# commits the state of its own step. Run from the repository root:
#   bash scripts/gpu_checks/staging.sh     # JSON to $OUT/staging.json when OUT is set; STAGING_GB=3.6 by default
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
PY=${PYTHON:-python3}
nvidia-smi -L 2>/dev/null || echo "(nvidia-smi: not found)"
"$PY" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
json=()
[ -n "${OUT:-}" ] && json=(--json "$OUT/staging.json")
timeout 150 "$PY" -m trainer.tools.bench staging --staging-gb "${STAGING_GB:-3.6}" --checkpoint-repeats 5 "${json[@]}"
echo "bench staging: exit $?"
timeout 60 "$PY" -m pytest -q -p no:cacheprovider -p no:xdist tests/unit/test_checkpoint_api.py \
    -k "reused_staging and cuda" 2>&1 | tail -5
echo "pytest (reused pinned buffers, CUDA): exit ${PIPESTATUS[0]}"
