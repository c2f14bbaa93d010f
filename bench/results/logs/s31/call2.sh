#!/usr/bin/env bash
# Session 31 call 2: the GEMV's wide W tiles split over K (gemv.wide_tiles). First the sweep at 40 rows
# (the b 8 verify), then the graphed 7B forward of a 5-token verify (b 1: 5 rows, b 8: 40) on cuBLAS
# (default), narrow 64-row tiles (gemv_m64) and wide tiles (wide, gemv_m64_wide[_norm]).
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
timeout 200 python3 bench/decode.py --steps 64 --no-hf --batches 1 8 --query-len 5 --sets default wide gemv_m64 gemv_m64_wide gemv_m64_wide_norm > $OUT/decode_q5.log 2>&1; echo "decode rc $?"
cp bench/results/decode.json $OUT/decode_q5.json
tail -25 $OUT/decode_q5.log
SPECDEC_GEMV_WIDE=1 timeout 300 python3 bench/gemv.py --m 40 --wide > $OUT/gemv_wide.log 2>&1; echo "gemv rc $?"
cp bench/results/gemv.json $OUT/gemv_wide.json
python3 - <<'PY'
import json
d = json.load(open("bench/results/gemv.json"))
for r in d["rows"]:
    ok = sorted((t for t in r.get("sweep", []) if "us" in t), key=lambda t: t["us"])[:3]
    print(r["proj"], r["m"], "floor %.1f cublas %.1f wide-default %.1f" % (r["floor_us"], r["cublas_us"], r["gemv_us"]),
          " | ".join("%d/%d/%d s%d st%d w%d %.1f" % (c["config"]["block_m"], c["config"]["block_n"], c["config"]["block_k"],
                     c["config"]["split_k"], c["config"]["num_stages"], c["config"]["num_warps"], c["us"]) for c in ok))
print(d["steps"])
PY
