#!/usr/bin/env bash
# Every end-to-end number of the README's performance section, in one run on one GPU machine:
# writes the llama-8b-shape model, then runs W1 (with the Hugging Face static-batch baseline on a
# subset), W2 (prefix caching on vs off) and W3 (three Poisson rates) through the full path:
# executor and scheduler as two processes, the bench client in a third.
#
#   OUT=bench-results bash scripts/gpu-bench.sh            # on the GPU machine, from the repo root
#   MODEL=/tmp/tiny SHAPE=tiny QUICK=1 bash scripts/gpu-bench.sh   # a CPU smoke run of the script
set -uo pipefail
OUT=${OUT:-bench-results}
MODEL=${MODEL:-/tmp/llama-8b-shape}
SHAPE=${SHAPE:-llama-8b}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then  # packages the GPU image lacks (structlog, asyncio-throttle)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
device=$(python3 -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")
[ -f "$MODEL/model.safetensors" ] || python3 -m pagedserve.cli make-model --shape "$SHAPE" --device "$device" "$MODEL"

bench() {  # bench NAME TIMEOUT ARGS...: one bench command, its log kept, a failure reported not fatal
  local name=$1 limit=$2; shift 2
  echo "=== $name: pagedserve bench $*"
  timeout "$limit" python3 -m pagedserve.cli bench --launch --model "$MODEL" --log-dir "$OUT/logs-$name" \
    --result-file "$OUT/$name.json" --plot "$OUT/$name.png" "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name exit=$?"; tail -n 40 "$OUT/$name.txt"
}

if [ -n "${QUICK:-}" ]; then  # a handful of requests of each kind, to check the script itself
  small=(--num-prompts 8 --input-len 16:64 --output-len 4:16)
  bench w1 300 --workload W1 "${small[@]}" --baseline hf-static --baseline-num-prompts 4 --executor-args "--device cpu"
  bench w2 300 --workload W2 --num-prompts 8 --prefix-len 64 --input-len 8 --output-len 4 --compare-prefix-caching --executor-args "--device cpu"
  bench w3 300 --workload W3 "${small[@]}" --request-rates 4,16 --executor-args "--device cpu"
else
  bench w1 200 --workload W1 --num-warmups 8 --baseline hf-static --baseline-num-prompts 32
  bench w2 150 --workload W2 --num-warmups 8 --compare-prefix-caching
  bench w3 150 --workload W3 --num-warmups 8 --num-prompts 48 --request-rates 2,8,32
fi
