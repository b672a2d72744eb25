#!/usr/bin/env bash
# W4 (8 shared 1,024-token prefixes x 64 requests, interleaved) on CPU executors with a tiny model:
# output tok/s with 1, 2, 4 executors behind one scheduler (exact prefix routing), and prefill
# tokens computed with prefix routing vs round robin. Meant for a many-core machine (the GPU
# machine's 16 cores); each executor gets cores / N threads (serve's placement).
#   OUT=w4-results bash scripts/w4-cpu.sh
#   OUT=w4-results RUNS="prefix:4 round_robin:4" bash scripts/w4-cpu.sh   # some runs (POLICY:EXECUTORS)
set -uo pipefail
OUT=${OUT:-w4-results}
RUNS=${RUNS:-prefix:1 prefix:2 prefix:4 round_robin:4 least_loaded:4 prefix:3 round_robin:3}
MODEL=${MODEL:-/tmp/w4-tiny}
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
python3 - "$MODEL" <<'PY'
import sys
from pathlib import Path
from pagedserve.tiny_model import TinyModelSpec, write_tiny_model
if not (Path(sys.argv[1]) / "config.json").exists():  # W4's requests are 1,152 tokens long
    write_tiny_model(sys.argv[1], TinyModelSpec(max_position_embeddings=2048))
PY
run() {  # run NAME DP POLICY
  echo "=== $1 ($(date +%T))"
  python3 -m pagedserve.cli bench --launch --model "$MODEL" --workload W4 --num-warmups 0 --no-plot \
    --data-parallel-size "$2" --executor-args "--device cpu $EXTRA" \
    --scheduler-args "--routing-policy $3" --result-file "$OUT/$1.json" > "$OUT/$1.txt" 2>&1
  grep -E "output throughput|prompt tokens computed|duration" "$OUT/$1.txt"
}
for spec in $RUNS; do run "w4-dp${spec#*:}-${spec%%:*}" "${spec#*:}" "${spec%%:*}"; done
