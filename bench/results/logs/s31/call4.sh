#!/usr/bin/env bash
# Session 31 call 4: the graphed 5-token verify with the GEMV's 64-row tiles at 3 / 4 stages, with and
# without the widest projections left on cuBLAS, against the default (cuBLAS above 16 rows).
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
timeout 200 python3 bench/decode.py --steps 64 --no-hf --batches 1 8 --query-len 5 --sets default gemv_m64 gemv_m64_narrow > $OUT/decode_q5_m64.log 2>&1; echo "decode rc $?"
cp bench/results/decode.json $OUT/decode_q5_m64.json
tail -6 $OUT/decode_q5_m64.log | cut -c1-400
