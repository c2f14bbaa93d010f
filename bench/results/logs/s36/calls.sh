# Session 36's device calls (nvidia-h200, one GPU each), from the repository root with .whl carried.
# call 1 (305 s): --verify-ahead's new real-CUDA-graph tests and the chain kernel's GPU tests (10 passed,
# tests_call1.log), then the verify-ahead A/B with verify-ahead as side B (e2e_ab_verify_ahead_B.*)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/unit/test_verify_ahead.py tests/unit/test_chain_advance.py
E2E_AB_S=420 E2E_AB_ARGS="--passes 2 --b-args=--target-args=--verify-ahead --pass-timeout 200 -- --sections 7b --drafts llama-68m --deadline 150" OUT=$OUT bash bench/gpu_suite.sh e2e-ab
# call 2 (258 s): the chain kernel as side B (e2e_ab_chain_kernel_B.*)
E2E_AB_S=420 E2E_AB_ARGS="--passes 2 --b-env SPECDEC_CHAIN_KERNEL=1 --pass-timeout 200 -- --sections 7b --drafts llama-68m --deadline 150" OUT=$OUT bash bench/gpu_suite.sh e2e-ab
# call 3 (378 s): both A/Bs again with the change as side A (every B had won in calls 1-2, both changes
# alike: an order effect?) (e2e_ab_verify_ahead_A.*, e2e_ab_chain_kernel_A.*)
E2E_AB_S=290 E2E_AB_ARGS="--passes 2 --a-args=--target-args=--verify-ahead --pass-timeout 140 -- --sections 7b --drafts llama-68m --deadline 120" OUT=$OUT bash bench/gpu_suite.sh e2e-ab
E2E_AB_S=270 E2E_AB_ARGS="--passes 2 --a-env SPECDEC_CHAIN_KERNEL=1 --pass-timeout 140 -- --sections 7b --drafts llama-68m --deadline 120" OUT=$OUT bash bench/gpu_suite.sh e2e-ab
# call 4 (346 s), both now on by default: every GPU test (318 passed, 4 skipped: tests_call4.log), then the
# whole e2e (results/e2e.json, e2e_call4.log)
TESTS_S=240 OUT=$OUT bash bench/gpu_suite.sh tests
E2E_S=300 E2E_DEADLINE=280 OUT=$OUT bash bench/gpu_suite.sh e2e
# call 5 (100 s): the verify-ahead fast path on put_ids (PackedBuffer.put: the staged step's ids in one small
# copy): the GPU cases of test_verify_ahead.py, test_staging.py, tests/gpu/test_services_gpu.py and
# test_engines_gpu.py, 28 passed, 1 skipped (tests_call5.log)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; timeout 200 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider -rf tests/unit/test_verify_ahead.py tests/unit/test_staging.py tests/gpu/test_services_gpu.py tests/gpu/test_engines_gpu.py
