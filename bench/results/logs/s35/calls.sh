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
