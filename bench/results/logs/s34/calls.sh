# Session 34's device calls (nvidia-h200), each from the repository root with .whl carried.
# call 1 (245 s): the whole e2e on the memfd version of the shared step frames (1d92b4b; the step
# paths were not recorded yet: the coordinator's logs stay on the device)
E2E_S=290 E2E_DEADLINE=270 OUT=$OUT bash bench/gpu_suite.sh e2e
# call 2 (218 s): the 7B with the 68m and 160m drafts at 256 and then 64 tokens a request, the same code (ea50906, step paths recorded)
for n in 256 64; do E2E_S=200 E2E_DEADLINE=185 E2E_ARGS="--sections 7b --drafts llama-68m llama-160m --new-tokens $n" OUT=$OUT bash bench/gpu_suite.sh e2e > $OUT/call2_e2e_$n.log 2>&1; mv $OUT/e2e.json $OUT/e2e_new$n.json; done
# call 3 (253 s): the whole e2e at the new default of 256 tokens a request (results/e2e.json)
E2E_S=480 E2E_DEADLINE=450 OUT=$OUT bash bench/gpu_suite.sh e2e
# call 4 (249 s): shared frames on (A) against off (B: SPECDEC_STEP_SHM=0), the order swapped from session 33's call 3, 2 passes a side
E2E_AB_S=540 E2E_AB_ARGS="--passes 2 --b-env SPECDEC_STEP_SHM=0 --pass-timeout 200 -- --sections 7b --drafts llama-68m --deadline 150" OUT=$OUT bash bench/gpu_suite.sh e2e-ab
# call 5 (57 s): speculative steps in process (7B + 68m), b 1 and 8: host split, GPU idle by range, launches
GAPS_S=240 GAPS_ARGS="--batches 1 8 --steps 16" OUT=$OUT bash bench/gpu_suite.sh gaps
# call 6 (19 s): kernel timeline of the 7B's b 8 decode (q 1) and verify (q 5) forwards at context 256
TIMELINE_S=200 TIMELINE_SETS=default TIMELINE_ARGS="--shapes llama-7b --batches 8 --query-lens 1 5 --context 256" OUT=$OUT bash bench/gpu_suite.sh timeline
# call 7 (63 s): bench/launch_probe.py, first version: failed (torch keeps no cudaGraph_t without keep_graph=True)
# call 8 (22 s): launch_probe.py with the profiler fallback: the target's graphs listed; it then aborted on
# a draft chain graph replayed without staged inputs (the chains are left out since)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; cd bench && timeout 200 python3 launch_probe.py --batches 1 8
# call 9 (91 s): --pipeline on one GPU (a pipelined pass beside each speculative pass), 7B + 68m, 256 tokens
E2E_S=190 E2E_DEADLINE=175 E2E_ARGS="--sections 7b --drafts llama-68m --pipeline" OUT=$OUT bash bench/gpu_suite.sh e2e
