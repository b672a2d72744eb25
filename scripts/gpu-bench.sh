#!/usr/bin/env bash
# Every GPU figure of the documentation (docs/performance/results.md), on one GPU machine: writes the llama-8b-shape
# model, then runs the selected stages (default: all):
#   kernels    python -m benchmarks.kernels (K1 decode shapes and the prefill case vs SDPA)
#   step       python -m benchmarks.step (decode and mixed steps, graphs vs eager, GPU idle)
#   breakdown  python -m benchmarks.breakdown (matmul TFLOP/s by M, kernel time by kind, overlap)
#   w1         W1 with the throughput flags (W1_FLAGS) through three processes vs the same engine
#              in-process, + the HF static baseline; step traces of both passes
#   w1-default W1 with default flags (gRPC), with a step trace
#   w2         W2 with prefix caching on vs off
#   w3         W3 at three Poisson rates
#   pressure   W1 in a KV pool of 4,096 and 8,192 blocks (W1 peaks near 20,400): recompute vs swap
#   moe        python -m benchmarks.moe (the fused-MoE kernel on Qwen3-30B-A3B's layer at 64, 512 and
#              8,192 tokens, bf16 and FP8, vs a dense bf16 GEMM of the same FLOPs and a per-expert loop)
#   fp8-kernels python -m benchmarks.fp8 (FP8 linear vs bf16, fused quantizing kernels, K1
#              decode with an FP8 KV cache)
#   fp8-quality python -m benchmarks.fp8_quality (bits per byte and greedy agreement of the
#              built-in model: bf16, each FP8 flag, both)
#   w1-fp8     W1 with the throughput flags: bf16, --quantization fp8, and both FP8 flags
#   w5-fp8     W5 (128 x 12,000-token prompts, 512 outputs) with bf16 vs FP8 KV (weights FP8 in both,
#              or bf16 in both with W5_WEIGHTS=bf16; W5_MEMORY=F: --gpu-memory-utilization F in both)
#   scale-out  W1 and W4 through one scheduler with 2 executors sharing the GPU (half the memory
#              each) vs 1: throughput and the scheduler's CPU per step
#   w4-cpu     W4 on CPU executors (scripts/w4-cpu.sh): 1, 2, 3, 4 executors, prefix routing vs
#              round robin and least loaded
#   tp         W1 over one executor at --tensor-parallel-size 1 and 2 (needs 2 GPUs), step traces
#   w5-gemma   W5 on the gemma3-12b shape (5 local : 1 global layers, window 1024): out-of-window
#              blocks freed (the default) vs kept (--disable-hybrid-kv-cache-manager); GEMMA_VARIANTS
#              picks ("hybrid:" or "full-tables:--disable-hybrid-kv-cache-manager")
#   w1-moe     W1 on the qwen3-30b-a3b shape: bf16 (+ the HF static baseline on MOE_HF_PROMPTS
#              prompts, default 16; 0 skips it) and --quantization fp8 (MOE_VARIANTS picks), with
#              step traces (random weights drawn at start: --load-format dummy), and the kernel
#              time of its eager steps by kind (python -m benchmarks.breakdown steps --model)
#   w6-tier    W6 (multi-turn chat; a GPU pool of W6_GPU_BLOCKS=2304 blocks, a quarter of the histories)
#              without and with a CPU tier of W6_TIER_GIB=20 GiB; python -m benchmarks.kv_tier_copy
#              (the tier's copies vs the pinned host link); W1 with the tier off and on
#   plan       `pagedserve plan`'s KV pool against the executor's real one (scripts/plan_check.py:
#              plan --measure in a fresh process per utilization) at 0.85, 0.90, 0.92
#   tune       `pagedserve tune` over W3-like traffic (192 requests, Poisson 16 req/s): max_num_seqs
#              64/128/256 x prefix caching on/off at utilization 0.90; table, tune.json, tune.png
#   w1-json    W1 and W1-JSON (a JSON schema on every request) with the throughput flags, one after
#              the other, + python -m benchmarks.structured_masks (mask time per plan, 512 requests)
#              and benchmarks.hotpath --workload W1 / W1-JSON (the scheduler's CPU per step, this CPU);
#              on the shape with a 128,000-token tokenizer (dummy weights): the masks' cost depends on
#              the vocabulary, and the shape's own tokenizer has 512 tokens
#   latency    issue 33, small-batch decode: python -m benchmarks.small_m --sweep (bf16 cuBLAS vs FP8
#              _scaled_mm vs the weight-only kernel at M = 1..64, fraction of the copy bandwidth: sets
#              WEIGHT_ONLY_MAX_M), benchmarks.decode_profile (graph-step kernel time by kind vs the
#              weight + KV read floor, bf16 and FP8), then pagedserve bench at --max-concurrency 1,8,32
#              (512-token prompts, 256 outputs; ITL/TPOT beside the read floor) per LATENCY_VARIANTS
#              (default "bf16: fp8:--quantization,fp8": NAME:FLAGS, commas for spaces; add e.g.
#              "fp8-kv8:--quantization,fp8,--kv-cache-dtype,fp8"); LATENCY_PROMPTS requests per pass (32);
#              PAGEDSERVE_FP8_WEIGHT_ONLY_MAX_M=M in the environment overrides the FP8 threshold;
#              LATENCY_SWEEP=0 skips the small_m sweep; LATENCY_ENVS="PAGEDSERVE_PDL=1
#              PAGEDSERVE_PDL=0 PAGEDSERVE_GEMV_PREFETCH=1" runs the profiles and passes once per
#              setting (tagged -pdl-1, ...), each with a step trace (the GPU's idle time between steps)
#   spec       issue 30, speculative decoding: W7 on the built-in model (SPEC_MODEL) at --max-concurrency
#              1,4,16 without speculation, with ngram (k 4, lookup 4..2) and with draft_model (SPEC_DRAFT,
#              default src/pagedserve/models/default_draft; k SPEC_DRAFT_K, default 6, the docs' choice for
#              the built-in model): output tok/s per request, executor steps
#              per output token, acceptance rate and mean accepted length; then W1 on the llama-8b shape
#              with ngram and disable_by_batch_size 8 vs off (the cost of speculation configured)
# The end-to-end stages run executor and scheduler as two processes and the bench client in a third.
#
#   OUT=bench-results bash scripts/gpu-bench.sh                  # everything (about 15 minutes)
#   OUT=bench-results STAGES="w2 w3" bash scripts/gpu-bench.sh   # some stages
#   MODEL=/tmp/tiny SHAPE=tiny QUICK=1 STAGES="w1 w2 w3" bash scripts/gpu-bench.sh   # CPU smoke run
set -uo pipefail
OUT=${OUT:-bench-results}
MODEL=${MODEL:-/tmp/llama-8b-shape}
SHAPE=${SHAPE:-llama-8b}
STAGES=${STAGES:-kernels step breakdown w1 w1-default w2 w3 pressure}
# W1 is offline throughput: all 512 requests run at once, and a message per request every 4 tokens
# (first and last at once) keeps the scheduler ahead of the GPU (see benchmarks/results/2026-11-29-h200-s3/README.md).
W1_EXECUTOR_FLAGS="--max-num-seqs 512"
W1_SCHEDULER_FLAGS="--max-num-seqs 512 --stream-interval 4"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# pagedserve from this checkout, and the packages the GPU image lacks (carried in .whl/)
source "$(dirname "$0")/device-env.sh" "$(dirname "$0")/.."
device=$(python3 -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")

run() {  # run NAME TIMEOUT CMD...: one stage, its output kept; a failure is reported, not fatal
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T)): $*"
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "=== $name exit=$? ($(date +%T))"; tail -n "${TAIL:-40}" "$OUT/$name.txt"
}
bench() {  # bench NAME TIMEOUT ARGS...: pagedserve bench against launched services
  local name=$1 limit=$2; shift 2
  run "$name" "$limit" python3 -m pagedserve.cli bench --launch --model "$MODEL" --log-dir "$OUT/logs-$name" \
    --result-file "$OUT/$name.json" --plot "$OUT/$name.png" "$@"
}
wants() { [[ " $STAGES " == *" $1 "* ]]; }

if wants kernels; then run kernels 150 python3 -m benchmarks.kernels --result-file "$OUT/kernels.json"; fi
if wants breakdown; then run breakdown 200 python3 -m benchmarks.breakdown --result-file "$OUT/breakdown.json"; fi
if wants step; then
  run step 150 python3 -m benchmarks.step --layers 32 --init-on-device --batches 256 --steps 20 \
    --mixed-prompt 512 --service
fi
if wants moe; then run moe 300 python3 -m benchmarks.moe --result-file "$OUT/moe.json"; fi
if wants fp8-kernels; then run fp8-kernels 200 python3 -m benchmarks.fp8 --result-file "$OUT/fp8-kernels.json"; fi
if wants fp8-quality; then run fp8-quality 300 python3 -m benchmarks.fp8_quality --result-file "$OUT/fp8-quality.json"; fi
if wants w1 || wants w1-default || wants w2 || wants w3 || wants w1-fp8 || wants w5-fp8 || wants scale-out || wants tp \
  || wants plan || wants tune || wants w1-json || wants w6-tier || wants latency || wants spec; then
  [ -f "$MODEL/model.safetensors" ] || python3 -m pagedserve.cli make-model --shape "$SHAPE" --device "$device" "$MODEL"
fi
if [ -n "${QUICK:-}" ]; then  # a handful of requests of each kind, to check the script itself
  lengths=(--num-prompts 8 --input-len 16:64 --output-len 4:16)
  small=("${lengths[@]}" --executor-args "--device cpu")
  if wants w1; then
    bench w1 300 --workload W1 "${lengths[@]}" --compare-in-process \
      --baseline hf-static --baseline-num-prompts 4 --scheduler-args "$W1_SCHEDULER_FLAGS" \
      --executor-args "--device cpu $W1_EXECUTOR_FLAGS --step-trace $OUT/w1-trace.jsonl"
  fi
  if wants w2; then bench w2 300 --workload W2 --num-prompts 8 --prefix-len 64 --input-len 8 --output-len 4 --compare-prefix-caching --executor-args "--device cpu"; fi
  if wants w3; then bench w3 300 --workload W3 "${small[@]}" --request-rates 4,16; fi
else
  if wants w1; then
    bench w1 300 --workload W1 --num-warmups 8 --compare-in-process --baseline hf-static --baseline-num-prompts 32 \
      --executor-args "$W1_EXECUTOR_FLAGS --step-trace $OUT/w1-trace.jsonl" --scheduler-args "$W1_SCHEDULER_FLAGS"
  fi
  if wants w1-default; then
    bench w1-default 200 --workload W1 --num-warmups 8 --executor-args "--step-trace $OUT/w1-default-trace.jsonl"
  fi
  if wants w2; then bench w2 150 --workload W2 --num-warmups 8 --compare-prefix-caching; fi
  if wants w3; then bench w3 150 --workload W3 --num-warmups 8 --num-prompts 48 --request-rates 2,8,32; fi
  if wants scale-out; then
    for dp in 1 2; do
      bench "w1-dp$dp" 300 --workload W1 --num-warmups 8 --data-parallel-size "$dp" \
        --executor-args "$W1_EXECUTOR_FLAGS" --scheduler-args "$W1_SCHEDULER_FLAGS"
    done
    for run in prefix:1 prefix:2 round_robin:2; do
      bench "w4-dp${run#*:}-${run%%:*}" 200 --workload W4 --num-warmups 0 --data-parallel-size "${run#*:}" \
        --scheduler-args "--routing-policy ${run%%:*}"
    done
  fi
  if wants tp; then
    for tp in 1 2; do
      bench "w1-tp$tp" 300 --workload W1 --num-warmups 8 --scheduler-args "$W1_SCHEDULER_FLAGS" \
        --executor-args "$W1_EXECUTOR_FLAGS --tensor-parallel-size $tp --step-trace $OUT/w1-tp$tp-trace.jsonl"
    done
  fi
  if wants pressure; then
    for blocks in 4096 8192; do for mode in recompute swap; do
      bench "pressure-$blocks-$mode" 200 --workload W1 --num-warmups 8 \
        --executor-args "$W1_EXECUTOR_FLAGS --num-gpu-blocks-override $blocks --swap-space 24" \
        --scheduler-args "$W1_SCHEDULER_FLAGS --preemption-mode $mode"
    done; done
  fi
fi
# FP8 passes, side by side with bf16. QUICK runs the same lines on the CPU through the FP8 references
# (PAGEDSERVE_FP8_REFERENCE=1, see executor.quantization) with a handful of short requests.
fp8_w1=(--num-warmups 8) fp8_w5=(--num-warmups 0) fp8_executor="" w5_len=12544  # 12,000 + 512 tokens
if [ -n "${QUICK:-}" ]; then
  export PAGEDSERVE_FP8_REFERENCE=1
  fp8_w1=(--num-prompts 4 --input-len 16:48 --output-len 4:8) fp8_executor="--device cpu"
  fp8_w5=(--num-prompts 4 --input-len 96 --output-len 4) w5_len=512
fi
if wants w1-fp8; then
  for variant in "bf16:" "fp8:--quantization fp8" "fp8-kv8:--quantization fp8 --kv-cache-dtype fp8"; do
    trace="$OUT/w1-${variant%%:*}-trace.jsonl"
    bench "w1-${variant%%:*}" 240 --workload W1 "${fp8_w1[@]}" --scheduler-args "$W1_SCHEDULER_FLAGS" \
      --executor-args "$fp8_executor $W1_EXECUTOR_FLAGS ${variant#*:} --step-trace $trace"
    run "w1-${variant%%:*}-steps" 60 python3 -m pagedserve.executor.step_trace "$trace"
  done
fi
if wants latency; then  # issue 33 (QUICK: the same on the CPU, tiny shapes, the FP8 references)
  lat_prompts=${LATENCY_PROMPTS:-32} lat_len=(--input-len 512 --output-len 256) lat_conc=1,8,32
  lat_sm=(python3 -m benchmarks.small_m --sweep) lat_dp=() lat_warm=4
  if [ -n "${QUICK:-}" ]; then  # the Triton kernel interpreted
    lat_prompts=4 lat_len=(--input-len 16:48 --output-len 4:8) lat_conc=1,2,4 lat_warm=0
    lat_sm=(env TRITON_INTERPRET=1 "${lat_sm[@]}" --device cpu --quick)
    lat_dp=(--device cpu --batches 1,2 --context 32 --steps 4 --replays 2)
  fi
  [ "${LATENCY_SWEEP:-1}" = 0 ] || run small-m 400 "${lat_sm[@]}" --result-file "$OUT/small-m.json"
  lat_envs=${LATENCY_ENVS:-PAGEDSERVE_PDL=1}
  for setting in $lat_envs; do  # one pass per setting, e.g. "PAGEDSERVE_PDL=1 PAGEDSERVE_PDL=0"
    export "${setting?}"
    tag="" && [ "$lat_envs" != PAGEDSERVE_PDL=1 ] && tag=-$(echo "${setting#PAGEDSERVE_}" | tr 'A-Z_=' 'a-z--')
    for quant in bf16 fp8; do
      qflag=() && [ "$quant" = fp8 ] && qflag=(--quantization fp8)
      run "decode-profile-$quant$tag" 200 python3 -m benchmarks.decode_profile "${qflag[@]}" "${lat_dp[@]}" \
        --result-file "$OUT/decode-profile-$quant$tag.json"
    done
    for variant in ${LATENCY_VARIANTS:-bf16: fp8:--quantization,fp8}; do
      variant=${variant//,/ }  # "fp8-kv8:--quantization,fp8,--kv-cache-dtype,fp8": commas for spaces
      bench "latency-${variant%%:*}$tag" 420 --num-prompts "$lat_prompts" "${lat_len[@]}" --request-rate inf \
        --num-warmups "$lat_warm" --max-concurrency "$lat_conc" \
        --executor-args "$fp8_executor ${variant#*:} --step-trace $OUT/latency-${variant%%:*}$tag-trace.jsonl"
      run "latency-${variant%%:*}$tag-steps" 60 python3 -m pagedserve.executor.step_trace \
        "$OUT/latency-${variant%%:*}$tag-trace.jsonl"
    done
    unset "${setting%%=*}"
  done
fi
if wants spec; then  # issue 30 (QUICK: the same passes on the CPU, a few short requests)
  root=$(cd "$(dirname "$0")/.." && pwd)
  spec_model=${SPEC_MODEL:-$root/src/pagedserve/models/default}
  spec_draft=${SPEC_DRAFT:-$root/src/pagedserve/models/default_draft}
  ngram='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2}'
  draft_cfg="{\"method\":\"draft_model\",\"model\":\"$spec_draft\",\"num_speculative_tokens\":${SPEC_DRAFT_K:-6}}"
  spec_w7=(--workload W7 --num-warmups 2 --max-concurrency 1,4,16) spec_exec="" spec_w1=(--num-warmups 8)
  if [ -n "${QUICK:-}" ]; then
    spec_w7=(--workload W7 --num-prompts 4 --output-len 16 --num-warmups 0 --max-concurrency 1,2) spec_exec="--device cpu"
    spec_w1=(--num-prompts 8 --input-len 16:64 --output-len 4:16)
  fi
  python3 -c "import sys; from pagedserve.bench.workloads import PRESETS; sys.exit('W7' not in PRESETS)" \
    || echo "=== spec: this checkout has no W7 preset (pagedserve.bench.workloads); the W7 passes will fail"
  variants=("off:" "ngram:$ngram")
  if [ -f "$spec_draft/config.json" ]; then
    variants+=("draft:$draft_cfg")
  else
    echo "=== spec: no draft model at $spec_draft (python -m scripts.train_default_model --draft-of" \
      "src/pagedserve/models/default --output src/pagedserve/models/default_draft); draft_model pass skipped"
  fi
  for variant in "${variants[@]}"; do
    cfg=() && [ -n "${variant#*:}" ] && cfg=(--speculative-config "${variant#*:}")
    MODEL=$spec_model bench "spec-w7-${variant%%:*}" 600 "${spec_w7[@]}" --executor-args "$spec_exec" "${cfg[@]}"
  done
  # W1 at 512 running requests: speculation configured but off above 8 (disable_by_batch_size) vs none.
  ngram_w1='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4,"prompt_lookup_min":2,"disable_by_batch_size":8}'
  for variant in "off:" "ngram:$ngram_w1"; do
    cfg=() && [ -n "${variant#*:}" ] && cfg=(--speculative-config "${variant#*:}")
    bench "spec-w1-${variant%%:*}" 300 --workload W1 "${spec_w1[@]}" --scheduler-args "$W1_SCHEDULER_FLAGS" \
      --executor-args "$spec_exec $W1_EXECUTOR_FLAGS" "${cfg[@]}"
  done
fi
if wants w5-fp8; then
  w5_model=$MODEL
  if [ -z "${QUICK:-}" ]; then  # W5's 12,544 tokens need more than the shape's 8,192 positions:
    w5_model=$MODEL-131k         # the same weights with Llama-3.1-8B's own 131,072
    mkdir -p "$w5_model" && ln -sf "$MODEL"/* "$w5_model"/ && rm "$w5_model/config.json"
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c['max_position_embeddings'] = 131072
json.dump(c, open(sys.argv[2], 'w'))" "$MODEL/config.json" "$w5_model/config.json"
  fi
  # The weights of both passes: FP8 (W5_WEIGHTS=fp8, the default) or the model's bf16 (W5_WEIGHTS=bf16)
  w5_weights=${W5_WEIGHTS:-fp8} w5_quant="--quantization fp8" w5_name=w5
  [ "$w5_weights" = bf16 ] && w5_quant="" w5_name=w5-bf16-weights
  # W5_MEMORY=0.6: both passes with --gpu-memory-utilization 0.6, so that neither pool holds all 128
  w5_memory="" && [ -n "${W5_MEMORY:-}" ] && w5_memory="--gpu-memory-utilization $W5_MEMORY" w5_name=$w5_name-mem$W5_MEMORY
  for variant in "kv-auto:" "kv-fp8:--kv-cache-dtype fp8"; do
    MODEL=$w5_model bench "$w5_name-${variant%%:*}" 300 --workload W5 "${fp8_w5[@]}" --scheduler-args "--max-num-seqs 128" \
      --executor-args "$fp8_executor --max-num-seqs 128 --max-model-len $w5_len $w5_quant $w5_memory ${variant#*:}"
  done
fi
if wants w5-gemma; then  # a second model: its own directory, written here if absent
  gemma=${GEMMA_MODEL:-/tmp/gemma3-12b-shape} gemma_w5=(--num-warmups 0) gemma_len=12544
  [ -n "${QUICK:-}" ] && gemma_w5=(--num-prompts 4 --input-len 96 --output-len 4) gemma_len=512
  [ -f "$gemma/model.safetensors" ] || python3 -m pagedserve.cli make-model --shape gemma3-12b --device "$device" "$gemma"
  for variant in ${GEMMA_VARIANTS:-hybrid: full-tables:--disable-hybrid-kv-cache-manager}; do
    MODEL=$gemma bench "w5-gemma-${variant%%:*}" 300 --workload W5 "${gemma_w5[@]}" --scheduler-args "--max-num-seqs 128" \
      --executor-args "$fp8_executor --max-num-seqs 128 --max-model-len $gemma_len ${variant#*:}"
  done
fi
if wants w1-moe; then
  moe=${MOE_MODEL:-/tmp/qwen3-30b-a3b-shape}
  # 61 GB of bf16 would nearly fill the machine's disk: config and tokenizer only, random weights at start
  [ -f "$moe/config.json" ] || python3 -m pagedserve.cli make-model --shape qwen3-30b-a3b --no-weights "$moe"
  for variant in ${MOE_VARIANTS:-bf16 fp8}; do
    quant="" baseline=()
    [ "$variant" = fp8 ] && quant="--quantization fp8"
    [ "$variant" = bf16 ] && [ "${MOE_HF_PROMPTS:-16}" != 0 ] && baseline=(--baseline hf-static --baseline-num-prompts "${MOE_HF_PROMPTS:-16}")
    trace="$OUT/w1-moe-$variant-trace.jsonl"
    MODEL=$moe bench "w1-moe-$variant" 420 --workload W1 "${fp8_w1[@]}" "${baseline[@]}" --scheduler-args "$W1_SCHEDULER_FLAGS" \
      --executor-args "$fp8_executor $W1_EXECUTOR_FLAGS --load-format dummy $quant --step-trace $trace"
    run "w1-moe-$variant-steps" 60 python3 -m pagedserve.executor.step_trace "$trace"
  done
  [ -z "${QUICK:-}" ] && run w1-moe-breakdown 200 python3 -m benchmarks.breakdown steps --model "$moe" \
    --result-file "$OUT/w1-moe-breakdown.json"  # kernel time by kind of eager steps
fi
if wants w6-tier; then  # issue 29: the CPU tier on W6, with a GPU pool of about a quarter of the histories
  w6_pool="--num-gpu-blocks-override ${W6_GPU_BLOCKS:-2304}" w6_tier="--kv-offloading-size ${W6_TIER_GIB:-20}"
  w6_args=(--num-warmups 0)
  if [ -n "${QUICK:-}" ]; then
    w6_args=(--num-prompts 4 --num-turns 3 --input-len 32 --output-len 8)
    w6_pool="--device cpu --max-model-len 256 --num-gpu-blocks-override 32" w6_tier="--kv-offloading-size 0.05"
  fi
  bench w6-no-tier 300 --workload W6 "${w6_args[@]}" --executor-args "$w6_pool"
  bench w6-tier 300 --workload W6 "${w6_args[@]}" --executor-args "$w6_pool $w6_tier"
  if [ -z "${QUICK:-}" ]; then  # the tier's copies against the host link; W1 with the tier (no hits there)
    run kv-tier-copy 120 python3 -m benchmarks.kv_tier_copy --result-file "$OUT/kv-tier-copy.json"
    for variant in "off:" "on:$w6_tier"; do
      bench "w1-tier-${variant%%:*}" 240 --workload W1 --num-warmups 8 --scheduler-args "$W1_SCHEDULER_FLAGS" \
        --executor-args "$W1_EXECUTOR_FLAGS ${variant#*:}"
    done
  fi
fi
# plan and tune (issue 32). QUICK: the same commands on the CPU with the tiny model and a 2-point grid.
plan_device=() tune_grid=(--max-num-seqs 64,128,256 --gpu-memory-utilization 0.90) tune_traffic=(--num-prompts 192 --request-rate 16)
tune_executor="" tune_timeout=560
if [ -n "${QUICK:-}" ]; then
  plan_device=(-- --device cpu) tune_grid=(--max-num-seqs 8) tune_traffic=(--num-prompts 12 --request-rate 8)
  tune_executor="--device cpu --max-model-len 1024" tune_timeout=300
fi
if wants plan; then
  run plan 560 python3 -m scripts.plan_check --model "$MODEL" --utilizations 0.85,0.90,0.92 \
    --result-file "$OUT/plan-check.json" "${plan_device[@]}"
fi
if wants tune; then
  run tune "$tune_timeout" python3 -m pagedserve.cli tune --model "$MODEL" --workload W3 "${tune_traffic[@]}" \
    "${tune_grid[@]}" --enable-prefix-caching on,off --slo-ttft-p99 1000 --executor-args "$tune_executor" \
    --result-file "$OUT/tune.json" --plot "$OUT/tune.png" --log-dir "$OUT/logs-tune"
fi
if wants w4-cpu; then
  echo "=== w4-cpu ($(date +%T))"
  OUT="$OUT/w4-cpu" bash "$(dirname "$0")/w4-cpu.sh"
fi
for trace in "$OUT"/w1*trace*.jsonl; do  # where each W1 pass's GPU time went
  [ -f "$trace" ] && { echo "=== $trace"; python3 -m pagedserve.executor.step_trace "$trace" | sed -n 1,8p; python3 -m pagedserve.executor.step_trace "$trace" | tail -n 1; }
done
if wants w1-json; then  # issue 31: structured outputs' cost, W1 against W1-JSON in one run
  json_args=(--num-warmups 8 --executor-args "$W1_EXECUTOR_FLAGS --load-format dummy" --scheduler-args "$W1_SCHEDULER_FLAGS")
  [ -n "${QUICK:-}" ] && json_args=(--num-prompts 8 --input-len 16:64 --output-len 4:16 --executor-args "--device cpu")
  (
    if [ -z "${QUICK:-}" ]; then  # a real model's vocabulary (the QUICK model keeps its own)
      MODEL="$MODEL-tok128k"
      [ -f "$MODEL/tokenizer.json" ] || python3 -m pagedserve.cli make-model --shape "$SHAPE" --no-weights \
        --tokenizer-vocab-size 128000 "$MODEL"
    fi
    bench w1-json-off 300 --workload W1 "${json_args[@]}"
    bench w1-json-on 300 --workload W1-JSON "${json_args[@]}"
    run w1-json-masks 300 python3 -m benchmarks.structured_masks --model "$MODEL" --requests 512 --steps 300 \
      --result-file "$OUT/w1-json-masks.json"
    run w1-json-hotpath-off 200 python3 -m benchmarks.hotpath --model "$MODEL" --workload W1
    run w1-json-hotpath-on 200 python3 -m benchmarks.hotpath --model "$MODEL" --workload W1-JSON
  )
fi
