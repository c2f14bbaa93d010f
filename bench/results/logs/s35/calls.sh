# Session 35's device calls (nvidia-h200), each from the repository root with .whl carried.
# call 1 (81 s): gaps.py with the new per-graph replay() split (launch_split_steps)
GAPS_S=200 GAPS_ARGS="--batches 1 8 --steps 16" OUT=$OUT bash bench/gpu_suite.sh gaps
# call 2 (76 s): gaps.py with the CUDA-event timeline of bare steps (event_timeline_steps), 24 steps
GAPS_S=150 GAPS_ARGS="--batches 1 8 --steps 24" OUT=$OUT bash bench/gpu_suite.sh gaps
# call 3 (92 s): cProfile of 24 speculative steps (anatomy --host-profile), then the 68m's kernels at b 1 / 8
ANATOMY_S=200 ANATOMY_ARGS="--batches 1 8 --host-profile --steps 24" OUT=$OUT bash bench/gpu_suite.sh anatomy
TIMELINE_S=150 TIMELINE_SETS=default TIMELINE_ARGS="--shapes llama-68m --batches 1 8 --query-lens 1 --context 256" OUT=$OUT bash bench/gpu_suite.sh timeline
# calls 4, 5, 8 (70, 76, 82 s): launch_probe.py --conditions (replay() host time after staging, waits,
# syncs, the other engine's replay, the graph's own argmax; conditions were added between the calls)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site; cd bench && timeout 300 python3 launch_probe.py --conditions --batches 1 8
# call 6 (49 s): gaps.py --launch-variants, first version (a variant with the draft's chains refused:
# a speculative step failed in it; the variant was dropped)
# call 7 (24 s): gaps.py --launch-variants (the replay() split for plain steps too)
GAPS_S=200 GAPS_ARGS="--batches 1 8 --steps 16 --launch-variants" OUT=$OUT bash bench/gpu_suite.sh gaps
# call 9 (70 s): gaps.py --launch-variants with plain steps also without the clock's CUDA events and with gc off
GAPS_S=200 GAPS_ARGS="--batches 1 8 --steps 16 --launch-variants" OUT=$OUT bash bench/gpu_suite.sh gaps
# (a start that failed here cost 121 s of the budget)
# call 10 (121 s): the chain-advance kernel (then on by default): its GPU tests and the graph / engine GPU tests,
# then gaps.py at b 8 with the kernel (A, cut by its 45 s limit before printing) and without (B)
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site
timeout 90 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider -rf tests/unit/test_chain_advance.py tests/gpu/test_cuda_graphs_gpu.py tests/gpu/test_engines_gpu.py
cd bench; for side in A B; do k=1; [ $side = B ] && k=0; SPECDEC_CHAIN_KERNEL=$k timeout 45 python3 gaps.py --batches 8 --steps 12; done
