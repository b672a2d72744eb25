#!/usr/bin/env bash
# A quick GPU check of the executor, in one device call: the CUDA tests, step timings of the
# 32-layer 8B shape (decode and mixed steps, graphs vs eager), and W1 through gRPC vs in-process.
#
#   OUT=bench-results bash scripts/gpu-check.sh
set -uo pipefail
OUT=${OUT:-bench-results}
MODEL=${MODEL:-/tmp/llama-8b-shape}
W1_ARGS=${W1_ARGS:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then  # packages the GPU image lacks (structlog, asyncio-throttle)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
stage() {  # stage NAME TIMEOUT CMD...: runs one stage with its output kept; a failure is reported, not fatal
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T)): $*"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name exit=$? ($(date +%T))"; tail -n "${TAIL:-25}" "$OUT/$name.txt"
}
[ -f "$MODEL/model.safetensors" ] || python3 -m pagedserve.cli make-model --shape llama-8b --device cuda "$MODEL" > "$OUT/make-model.txt" 2>&1 &
stage cuda-tests 150 python3 -m pytest -q -x tests/test_executor_cuda.py tests/test_kernels.py -k "cuda or graph"
stage step-bench 150 python3 -m executor.bench_step --layers 32 --init-on-device --batches 256 --steps 20 --mixed-prompt 512
wait
stage w1 260 python3 -m pagedserve.cli bench --launch --model "$MODEL" --workload W1 --compare-in-process \
  --num-warmups 8 --result-file "$OUT/w1.json" --plot "$OUT/w1.png" --log-dir "$OUT/logs-w1" $W1_ARGS
