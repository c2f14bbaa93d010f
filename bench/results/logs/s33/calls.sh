# Session 33's device calls (nvidia-h200), each from the repository root with .whl carried.
# call 1 (211 s): every GPU test, and the norm fusion at 40 rows (the b 8 verify) on the narrow 64-row tiles
TESTS_S=300 DECODE_SETS="default norm_m64" DECODE_ARGS="--batches 1 8 --query-len 5" bash bench/gpu_suite.sh tests decode
# call 2 (232 s): the whole e2e on one GPU
E2E_S=280 E2E_DEADLINE=260 bash bench/gpu_suite.sh e2e
# call 3 (244 s): shared-memory step frames A/B (A: SPECDEC_STEP_SHM=0, B: on), 7B + 68m, 2 passes a side
E2E_AB_S=540 E2E_AB_ARGS="--passes 2 --a-env SPECDEC_STEP_SHM=0 -- --sections 7b --drafts llama-68m --deadline 110" bash bench/gpu_suite.sh e2e-ab
# call 4 (264 s): a frame's one-way time with and without shared slots; the whole e2e with shared-memory frames (hf-7b cut by the deadline: call 2's e2e has it)
WAKEUP_S=60 WAKEUP_ARGS="--modes poll poll+shm poll+cuda poll+cuda+shm --frames 300" E2E_S=245 E2E_DEADLINE=225 bash bench/gpu_suite.sh wakeup e2e
# call 5 (44 s): after the move to sealed memfds (review fixes), the one-way times again; the pytest part
# failed to collect without gpu_suite.sh's .whl install (grpc_health missing there), so only wakeup ran
python3 -m pytest -q -p no:cacheprovider tests/unit/test_shared_slots.py tests/integration/test_step_channel_shared.py; cd bench && timeout 60 python3 wakeup.py --modes poll poll+shm poll+cuda+shm --frames 200
