# Session 38's device calls (one NVIDIA H200, driver 580.159.04; the same host for both calls), from the
# repository root with .whl carried. Seven tries failed before call 1 (no machine), ~690 s of the budget.
# call 1 (428 s): the unrolled-chain tests on real CUDA graphs with the existing graph tests (7 passed,
# tests_call1.log); then the A/B of SPECDEC_CHAIN_UNROLL=8 as side B, order abba (A B, B A), 7B + 68m
# (e2e_ab_chain_unroll_B.*; e2e_call1_last_pass_A.json: the last pass, side A, as e2e.py wrote it)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; unset TRITON_INTERPRET; timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/unit/test_chain_unroll.py tests/gpu/test_cuda_graphs_gpu.py
E2E_AB_S=400 E2E_AB_ARGS="--passes 2 --b-env SPECDEC_CHAIN_UNROLL=8 --pass-timeout 190 -- --sections 7b --drafts llama-68m --deadline 150" OUT=$OUT bash bench/gpu_suite.sh e2e-ab
# call 2 (478 s): the whole e2e (results/e2e.json, e2e_call2.log), decode (results/decode.json,
# decode_call2.log), cost_coefficient (cut by its 120 s limit after the 7B and 68m rows: cost_call2_cut_at_120s.log;
# results/cost_coefficient.json stays the run of 2026-12-03)
E2E_S=290 E2E_DEADLINE=270 OUT=$OUT bash bench/gpu_suite.sh e2e
DECODE_S=100 COST_S=120 OUT=$OUT bash bench/gpu_suite.sh decode cost
