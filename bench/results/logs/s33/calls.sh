# Session 33's device calls (nvidia-h200), each from the repository root with .whl carried.
# call 1 (211 s): every GPU test, and the norm fusion at 40 rows (the b 8 verify) on the narrow 64-row tiles
TESTS_S=300 DECODE_SETS="default norm_m64" DECODE_ARGS="--batches 1 8 --query-len 5" bash bench/gpu_suite.sh tests decode
# call 2 (232 s): the whole e2e on one GPU
E2E_S=280 E2E_DEADLINE=260 bash bench/gpu_suite.sh e2e
