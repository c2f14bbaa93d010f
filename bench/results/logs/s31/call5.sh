#!/usr/bin/env bash
# Session 31 call 5: gemv_m64_narrow where it changes other steps: the 7B decode at b 32 (32 rows) and c
# (the drafts' b 32 decode) against the default.
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
timeout 100 python3 bench/decode.py --steps 64 --no-hf --batches 32 --sets default gemv_m64_narrow > $OUT/decode_b32.log 2>&1; echo "decode rc $?"
cp bench/results/decode.json $OUT/decode_b32_m64.json; tail -3 $OUT/decode_b32.log | cut -c1-300
timeout 130 python3 bench/cost_coefficient.py --no-hf --sets default gemv_m64_narrow > $OUT/cost_m64.log 2>&1; echo "cost rc $?"
cp bench/results/cost_coefficient.json $OUT/cost_m64.json; tail -14 $OUT/cost_m64.log | cut -c1-300
