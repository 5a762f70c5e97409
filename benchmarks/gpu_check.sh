#!/usr/bin/env bash
# The GPU check of the Pallas kernels: the kernel tests compiled for the GPU (no interpret
# mode) against the jnp reference, then the kernel benchmark at V4 sizes (one op per process,
# reference and kernels, recorded into v4kv_jax/measured.json, the table "auto" reads) and the
# decode benchmark (fp32 and release formats) with the reference and with the Pallas kernels. Needs jax with its CUDA plugin, pytest, pytest-xdist and hypothesis (not the
# pinned CPU environment); run from the repository root:
#
#     OUT=gpu_results bash benchmarks/gpu_check.sh
#
# Each phase has its own time limit, so one that hangs or fails still leaves the others'
# results. Writes under $OUT: env.txt, kernel_tests.log, bench.log, kernels_{hca,csa}.json,
# measured.json and decode_{reference,pallas_gpu}.json.
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
  $PY -m pytest tests/kernels -q -n 0 -p no:cacheprovider -k "not dispatch"
# One op per process, so an op that compiles or runs pathologically long costs only its limit.
for op in "hca --hca-contexts 131072" "csa --csa-contexts 32768"; do
  phase "${BENCH_LIMIT:-120}" "$OUT/bench.log" \
    $PY benchmarks/kernels.py --native --record --repeats 3 --ops $op \
    --out "$OUT/kernels_${op%% *}.json"
done
# --record timed each op with the reference and the kernels and rewrote the GPU rows of the
# table "auto" reads: bring it back and commit it.
cp v4kv_jax/measured.json "$OUT/measured.json"
for impl in reference pallas_gpu; do
  phase "${DECODE_LIMIT:-80}" "$OUT/bench.log" \
    $PY benchmarks/decode.py --contexts 32768 131072 --formats float32 release --skip-dense \
    --steps 5 --implementation $impl --out "$OUT/decode_$impl.json"
done
