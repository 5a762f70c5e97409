#!/usr/bin/env bash
# The GPU check of the Pallas kernels: the kernel tests compiled for the GPU (no interpret
# mode) against the jnp reference, then the kernel and decode benchmarks with the Pallas
# kernels and with the reference. Needs jax with its CUDA plugin, pytest and hypothesis
# (not the pinned CPU environment); run from the repository root:
#
#     OUT=gpu_results bash benchmarks/gpu_check.sh
#
# Each phase has its own time limit, so one that hangs or fails still leaves the others'
# results. Writes under $OUT: env.txt, kernel_tests.log, kernels_{pallas,reference}.json,
# decode.json and bench.log.
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}

{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  $PY -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

phase() {  # phase SECONDS LOG COMMAND...: runs COMMAND with a limit, appending to LOG
  local limit=$1 log=$2; shift 2
  echo "== $* (limit ${limit}s)" | tee -a "$log"
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  echo "== exit ${PIPESTATUS[0]}" | tee -a "$log"
}

V4KV_KERNEL_DEVICE=gpu phase "${TEST_LIMIT:-200}" "$OUT/kernel_tests.log" \
  $PY -m pytest tests/kernels -q -p no:cacheprovider -k "not dispatch"
phase "${BENCH_LIMIT:-120}" "$OUT/bench.log" \
  $PY benchmarks/kernels.py --native --implementation pallas_gpu --repeats 5 \
  --out "$OUT/kernels_pallas.json"
phase "${BENCH_LIMIT:-120}" "$OUT/bench.log" \
  $PY benchmarks/kernels.py --native --implementation reference --repeats 5 \
  --out "$OUT/kernels_reference.json"
phase "${BENCH_LIMIT:-120}" "$OUT/bench.log" \
  $PY benchmarks/decode.py --contexts 8192 32768 131072 --steps 10 --out "$OUT/decode.json"
