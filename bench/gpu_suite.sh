#!/usr/bin/env bash
# One device call: GPU tests, then the kernel/runner benchmarks, each stage under its own time limit so
# the call fits the device tool's 10-minute budget. Logs and JSON go to $OUT (default bench/results).
#   bash bench/gpu_suite.sh [tests] [decode] [cost] [attention] [gemv]   (default: the first four)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
stages=${*:-tests decode cost attention}
log=$OUT/gpu_suite.log
: > "$log"
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) ===" | tee -a "$log"
  local t0=$SECONDS
  timeout "$secs" "$@" >> "$log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s ===" | tee -a "$log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
for s in $stages; do
  case $s in
    tests) run tests "${TESTS_S:-150}" python3 -m pytest -q -m gpu tests -p no:cacheprovider ;;
    decode) run decode "${DECODE_S:-110}" python3 bench/decode.py --gemv ;;
    gemv) run gemv "${GEMV_S:-200}" python3 bench/gemv.py ;;
    cost) run cost "${COST_S:-90}" python3 bench/cost_coefficient.py ;;
    attention) run attention "${ATTN_S:-220}" python3 bench/attention.py --tune-seconds "${TUNE_S:-40}" ;;
    *) echo "unknown stage $s" | tee -a "$log" ;;
  esac
done
grep -E "passed|failed|error" "$log" | tail -5
