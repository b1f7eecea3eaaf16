#!/usr/bin/env bash
# Everything the project checks on a lent GPU machine, in one run of about 10 minutes (one CUDA GPU, the
# machine's own torch, no network): the CUDA tests (the whole of the files that hold them, so the machine's
# torch release is tried too), the checkpoint staging copy (staging.sh), `trainer bench gpu` on 8B-shaped
# layers, eager, compiled and compiled with float8, and the per-document attention kernels (attention.sh). Packages the machine lacks (torchdata, torchao) are
# installed from wheels in .whl/ when that folder is there. Results go to $OUT (or ./gpu_results).
#   bash scripts/gpu_checks/lent_gpu.sh                  # every part
#   bash scripts/gpu_checks/lent_gpu.sh tests staging    # some of them (tests, staging, bench, attention, muon)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c "import sys, torch, torchao; print('python', sys.version.split()[0], 'torch', torch.__version__, 'torchao', torchao.__version__)"

parts=" ${*:-tests staging bench attention} "

if [[ $parts == *" tests "* ]]; then
echo "== CUDA tests (and the rest of their files, on this torch)"
timeout 150 "$PY" -m pytest -q -p no:cacheprovider -p no:xdist -rfs tests/unit/test_torch_compat.py \
    tests/unit/test_observability.py tests/unit/test_checkpoint_api.py 2>&1 | tee "$OUT/cuda_tests.txt" | grep -E "^(FAILED|ERROR|SKIPPED|E  )|passed|failed" | tail -40
fi

if [[ $parts == *" staging "* ]]; then
echo "== checkpoint staging: fresh copy against reused pinned buffers"
OUT=$OUT timeout 200 bash scripts/gpu_checks/staging.sh 2>&1 | tail -30
fi

if [[ $parts == *" bench "* ]]; then
echo "== trainer bench gpu: 8B-shaped layers (4), seq 4096"
timeout 300 "$PY" -m trainer.tools.bench gpu --flavors llama3_8b_4l --variants eager,compile,compile_float8_tensorwise \
    --seq-len 4096 --steps small --case-timeout 140 --json "$OUT/bench_gpu.json" 2>&1 | tail -30
echo "bench gpu: exit ${PIPESTATUS[0]}"
fi

if [[ $parts == *" attention "* ]]; then
echo "== per-document attention kernels"
OUT=$OUT bash scripts/gpu_checks/attention.sh 2>&1 | tail -12
fi

if [[ $parts == *" muon "* ]]; then
echo "== Muon against AdamW: the optimizer step and the training step"
OUT=$OUT bash scripts/gpu_checks/muon.sh 2>&1 | tail -30
fi
