#!/usr/bin/env bash
# One-shot GPU check for a lent H200; the whole script stays under 8 minutes.
#   1. tests/test_kernels.py compiled on CUDA (adds bf16 and 2011-token sequences)
#   2. bench.kernels: decode attention GB/s vs a D2D copy, prefill TFLOP/s vs SDPA
#   3. bench.offline on a ~0.5B random llama, engine (Triton ops) vs transformers
# Needs only torch, triton, transformers, tokenizers, safetensors, pytest (no redis/fastapi).
# Logs go to $OUT (the device tool's folder) or /tmp/device_check; a summary table prints last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
LOG=${OUT:-/tmp/device_check}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
BUDGET=${BUDGET_S:-465}
MODEL_DIR=/tmp/conveyor-bench-0.5b

# Seconds a step may take: its own cap, but never past the overall budget.
cap() { local left=$((BUDGET - SECONDS - 5)); (( left < $1 )) && echo $((left > 1 ? left : 1)) || echo "$1"; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

# The checkpoint is CPU work: write it while the GPU runs the tests.
( timeout 200 $PY -m bench.kernels --make-model "$MODEL_DIR" >"$LOG/make_model.log" 2>&1 ) &
MAKE_PID=$!

echo "== kernel tests (CUDA)"
timeout "$(cap 230)" $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$LOG/tests.log"
TESTS_RC=${PIPESTATUS[0]}

echo "== kernel timings"
timeout "$(cap 120)" $PY -m bench.kernels --json "$LOG/kernels.json" 2>&1 | tee "$LOG/kernels.log"
KERNELS_RC=${PIPESTATUS[0]}

echo "== offline throughput (0.5B, uniform)"
wait "$MAKE_PID"
MAKE_RC=$?
OFFLINE_RC=skipped
if [[ $MAKE_RC -eq 0 ]]; then
  timeout "$(cap 200)" $PY -m bench.offline --model "$MODEL_DIR" --workload uniform \
    --device cuda --dtype bfloat16 2>&1 | tee "$LOG/offline.log"
  OFFLINE_RC=${PIPESTATUS[0]}
else
  cat "$LOG/make_model.log"
fi

echo
echo "== summary (${SECONDS}s)"
echo "| check | result |"
echo "| --- | --- |"
echo "| kernel tests | rc=$TESTS_RC $(grep -Eo '[0-9]+ (passed|failed)[^=]*' "$LOG/tests.log" | tail -1) |"
if [[ -f "$LOG/kernels.json" ]]; then
  $PY - "$LOG/kernels.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"| copy (read+write) | {r['copy_gbps']:.0f} GB/s |")
best = max(r["decode_gbps"], key=r["decode_gbps"].get)
print(f"| decode 64x4k, dispatch | {r['decode_gbps']['dispatch']:.0f} GB/s = "
      f"{r['decode_dispatch_share_of_copy']:.0%} of copy (target >= 70%) |")
print(f"| decode 64x4k, best ({best}) | {r['decode_share_of_copy']:.0%} of copy |")
p = r["prefill_tflops"]
print(f"| prefill 4x4k | {p['triton']:.0f} vs SDPA {p['sdpa']:.0f} TFLOP/s = "
      f"{r['prefill_share_of_sdpa']:.0%} (target >= 50%) |")
PYEOF
else
  echo "| kernel timings | rc=$KERNELS_RC, no results |"
fi
echo "| offline bench | rc=$OFFLINE_RC (make-model rc=$MAKE_RC) |"
grep -E '^\| (uniform|mixed) ' "$LOG/offline.log" 2>/dev/null || true
[[ $TESTS_RC -eq 0 && $KERNELS_RC -eq 0 ]]
