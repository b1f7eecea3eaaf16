#!/usr/bin/env bash
# On one CUDA GPU (about 8 minutes; the machine's own torch, no network): what only a GPU shows of Muon.
# `trainer bench gpu` on 8B-shaped layers (4 blocks, seq 4096, compiled), AdamW against Muon (Moonlight's
# match_rms_adamw learning-rate adjustment; Newton-Schulz in bfloat16 on whole matrices); and the Muon,
# context-parallel and loss-scale unit tests on this machine's torch release.
# Through scripts/gpu_checks/lent_gpu.sh, which installs the packages the machine lacks first:
#   bash scripts/gpu_checks/lent_gpu.sh muon     # results in $OUT (default ./gpu_results)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu_results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

# Each part's output goes to a file in $OUT (a benchmark's case runs in a process of its own, which a pipe would
# wait for past the part's time limit), and its tail is printed.
part() {  # name, seconds, command...
    local name=$1 seconds=$2; shift 2
    echo "== $name"
    timeout -k 10 "$seconds" "$@" > "$OUT/$name.txt" 2>&1 < /dev/null
    echo "$name: exit $?"
    tail -8 "$OUT/$name.txt"
}
part optimizer_step 90 "$PY" scripts/gpu_checks/optimizer_step.py "$OUT/optimizer_step.json"
part unit_tests 120 "$PY" -m pytest -q -p no:cacheprovider -p no:xdist tests/unit/test_muon.py \
    tests/unit/test_context_parallel.py tests/unit/test_loss_scale.py
for name in adamw muon; do
    extra=()
    [ $name = muon ] && extra=(--optimizer.name Muon --optimizer.muon.adjust_lr_fn match_rms_adamw)
    part "bench_$name" 160 "$PY" -m trainer.tools.bench gpu --flavors llama3_8b_4l --variants compile --seq-len 4096 \
        --steps small --case-timeout 150 --json "$OUT/bench_$name.json" "${extra[@]}"
done
