#!/usr/bin/env bash
# block_causal attention at an 8B layer's shapes on one CUDA GPU (seq 8192, 4 and 16 documents per sequence):
# forward+backward time and peak memory of compiled FlexAttention (the trainer's CUDA kernel), SDPA with a
# dense mask (its CPU kernel) and torch's varlen attention (comparison only), against causal SDPA. About a
# minute on an H100 (most of it compiling FlexAttention); no network, no torchao. The table also goes to
# $OUT/attention.json (default ./gpu_results).
#   bash scripts/gpu_checks/attention.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout 110 "$PY" scripts/gpu_checks/attention.py "$OUT/attention.json" 2>&1 | tee "$OUT/attention.txt"
echo "attention: exit ${PIPESTATUS[0]}"
