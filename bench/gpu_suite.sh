#!/usr/bin/env bash
# Device calls, each stage under its own time limit so a call fits the device tool's 10 minutes.
# Logs and the stages' JSON go to $OUT (default bench/results); only those files are copied, since
# the device returns a bounded number of files.
#   bash bench/gpu_suite.sh STAGE...
# Stages: tests (every GPU test, in parallel processes; parts: tests-gpu, tests-unit, tests-attention), numerics, e2e, e2e-mps
#         (the servers through CUDA MPS against without: E2E_MPS_ARGS, MPS_PASSES), e2e-ab (E2E_AB_ARGS:
#         bench/e2e_ab.py's arguments, e.g. "--passes 3 --b-args=--draft-args=--no-sampled-chains --
#         --sections 7b --drafts llama-68m --temperature 0.8 --top-k 50 --deadline 100"), e2e-profile
#         (profiles.tgz; PROFILE_BATCHES, default 1; PROFILE_ARGS: more e2e.py arguments), e2e-trace
#         (the transport's parts per call: bench/trace_steps.py; TRACE_ARGS, default --drafts llama-68m), wakeup
#         (how fast a process notices a frame, by how it waits: bench/wakeup.py), hostpath, serving, attention, decode (DECODE_SETS), cost (COST_SETS: kernel sets, default all), gemv,
#         anatomy (ANATOMY_ARGS), gaps (where the GPU waits in a speculative step; GAPS_ARGS), gaps-ab
#         (GAPS_AB_BASE: another commit's packages against this tree, GAPS_AB_ROUNDS alternations), launch-probe
#         (each graph's launch: host us, and when the GPU starts it; LAUNCH_BATCHES), tests-tp / allreduce / anatomy-tp (two GPUs; ANATOMY_TP: anatomy.py's --tensor-parallel
#         specs, default "1 2 2:nccl"), timeline (TIMELINE_SETS: kernel sets, default "default no_norm"; TIMELINE_ARGS:
#         more timeline.py arguments, e.g. "--shapes llama-7b --query-lens 1 5"), attention-grid, attention-loops.
#         A set may carry a server's graph bounds (common.graph_variant): COST_SETS="default default@4096
#         default@4096+256" times c with the bench's own bound, a 4096 one, and 4096 with a 256 set.
#         Suggested calls (each < 10 min):
#   bash bench/gpu_suite.sh tests                 # ~210 s with 8 workers (session 25)
#   bash bench/gpu_suite.sh e2e                   # ~250 s on one H200 at 256 tokens a request (session 34; E2E_ARGS: more e2e.py arguments)
#   bash bench/gpu_suite.sh decode cost gemv      # ~90 s, then: attention (~200 s), serving
# The device image lacks grpcio-health-checking / grpcio-reflection: put their 1.84.0 wheels in
# .whl (pip download --no-deps --only-binary=:all: -d .whl ...) and carry it; they are installed
# to /tmp/site here.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)   # absolute: stages that run in another folder (gaps-ab) write here too
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
log=$OUT/gpu_suite.log
: > "$log"
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  echo "=== $name (limit ${secs}s) ===" | tee -a "$log"
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s ===" | tee -a "$log"
  tail -n "${TAIL:-15}" "$OUT/$name.log" | cut -c1-200
  return $rc
}
keep() {  # copy result JSON into $OUT (when it is not bench/results itself)
  for f in "$@"; do
    [ -f "bench/results/$f" ] && [ "$(realpath "$OUT")" != "$(realpath bench/results)" ] && cp "bench/results/$f" "$OUT/"
  done
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$log"
for s in "$@"; do
  case $s in
    # every GPU test, attention included, in TEST_WORKERS pytest-xdist processes sharing the GPU
    # (the image has xdist; session 25: 310 passed in 208 s with 8, where one process took > 900 s)
    tests) run tests "${TESTS_S:-400}" python3 -m pytest -q -m gpu -n "${TEST_WORKERS:-8}" -p no:cacheprovider -rf tests ;;
    # the same in parts
    tests-gpu) run tests-gpu "${TESTS_S:-300}" python3 -m pytest -q -m gpu -n "${TEST_WORKERS:-8}" -p no:cacheprovider -rf \
             tests/gpu tests/integration --ignore tests/gpu/test_triton_attention_gpu.py ;;
    tests-unit) run tests-unit "${TESTS_S:-300}" python3 -m pytest -q -m gpu -n "${TEST_WORKERS:-8}" -p no:cacheprovider -rf \
             tests/unit ;;
    tests-attention) run tests-attention "${ATTN_TESTS_S:-300}" python3 -m pytest -q -m gpu -n "${TEST_WORKERS:-8}" \
             -p no:cacheprovider -rf tests/gpu/test_triton_attention_gpu.py ;;
    numerics) run numerics "${NUMERICS_S:-120}" python3 bench/numerics.py; keep numerics.json ;;
    e2e) run e2e "${E2E_S:-450}" python3 bench/e2e.py --deadline "${E2E_DEADLINE:-420}" ${E2E_ARGS:-}; keep e2e.json ;;
    e2e-ab) run e2e-ab "${E2E_AB_S:-520}" python3 bench/e2e_ab.py ${E2E_AB_ARGS:?E2E_AB_ARGS: e2e_ab.py arguments}
            keep e2e_ab.json ;;
    # The draft and target servers through CUDA MPS (one shared GPU context: no time-sliced context
    # switches between the two processes at each Propose / Verify hand-over) against without, in
    # alternating e2e passes (E2E_MPS_ARGS: e2e.py's arguments; MPS_PASSES per side). The MPS control
    # daemon is a user-space process started here and stopped after; no GPU setting changes. Side A
    # points its processes at a pipe folder without a daemon, so they run without MPS. The control
    # log's client lines say whether B's processes did connect. Session 31 (H200, 7B + 68m, 2 passes): MPS
    # gave 0.96x / 0.90x the speculative tok/s at b 1 / 8 (logs/s31/e2e-mps.log): not used.
    e2e-mps)
      mps=/tmp/specdec-mps; mkdir -p $mps/pipe $mps/log $mps/none
      CUDA_MPS_PIPE_DIRECTORY=$mps/pipe CUDA_MPS_LOG_DIRECTORY=$mps/log nvidia-cuda-mps-control -d \
        || echo "e2e-mps: the MPS control daemon did not start" | tee -a "$log"
      run e2e-mps "${E2E_AB_S:-520}" python3 bench/e2e_ab.py --passes "${MPS_PASSES:-2}" \
        --a-env CUDA_MPS_PIPE_DIRECTORY=$mps/none --b-env CUDA_MPS_PIPE_DIRECTORY=$mps/pipe \
        -- ${E2E_MPS_ARGS:---sections 7b --drafts llama-68m --deadline 100}
      echo quit | CUDA_MPS_PIPE_DIRECTORY=$mps/pipe nvidia-cuda-mps-control
      grep -i "client" $mps/log/control.log | tail -n 6 | tee -a "$log"
      keep e2e_ab.json ;;
    e2e-profile)  # the 7B pairs with every process profiled, as one tarball (the device returns <= 8 files); 64 tokens a request
      rm -rf /tmp/specdec-profiles && mkdir -p /tmp/specdec-profiles
      SPECDEC_PROFILE_DIR=/tmp/specdec-profiles run e2e-profile "${E2E_S:-200}" python3 bench/e2e.py \
        --sections 7b --batches-7b ${PROFILE_BATCHES:-1} --deadline "${E2E_DEADLINE:-150}" --new-tokens 64 ${PROFILE_ARGS:-}
      tar czf "$OUT/profiles.tgz" -C /tmp/specdec-profiles . ;;
    e2e-trace)  # the transport split into its parts (specdec/trace.py stamps, bench/trace_steps.py); 64 tokens a request
      rm -rf /tmp/specdec-trace
      SPECDEC_TRACE_DIR=/tmp/specdec-trace run e2e-trace "${E2E_S:-200}" python3 bench/e2e.py \
        --sections 7b --deadline "${E2E_DEADLINE:-150}" --new-tokens 64 ${TRACE_ARGS:---drafts llama-68m}
      run trace-steps 60 python3 bench/trace_steps.py /tmp/specdec-trace; keep trace_steps.json ;;
    serving) run serving "${SERVING_S:-400}" python3 bench/serving.py; keep serving.json serving.png ;;
    attention) run attention "${ATTN_S:-260}" python3 bench/attention.py --tune-seconds "${TUNE_S:-60}"; keep attention.json ;;
    decode) run decode "${DECODE_S:-120}" python3 bench/decode.py --steps 64 --no-hf ${DECODE_SETS:+--sets $DECODE_SETS} ${DECODE_ARGS:-}
            keep decode.json ;;
    cost) run cost "${COST_S:-150}" python3 bench/cost_coefficient.py --no-hf ${COST_SETS:+--sets $COST_SETS}
          keep cost_coefficient.json ;;
    gemv) run gemv "${GEMV_S:-120}" python3 bench/gemv.py ${GEMV_ARGS:---m 1 8}; keep gemv.json ;;
    gaps) run gaps "${GAPS_S:-150}" python3 bench/gaps.py ${GAPS_ARGS:-}; keep gaps.json ;;
    gaps-ab)  # gaps.py over GAPS_AB_BASE (another commit's packages, as e2e_ab.py --a-code takes them:
              # this tree's bench is copied in, models linked) and this tree in turn, then compared
      base=${GAPS_AB_BASE:?GAPS_AB_BASE: a folder holding the coordinator, protos, specdec, draft_server and target_server of another commit}
      rm -rf "$base/bench" && cp -r bench "$base/" && ln -sfn "$PWD/models" "$base/models"
      specs=()
      for r in $(seq "${GAPS_AB_ROUNDS:-2}"); do
        for side in A B; do
          dir=.; [ "$side" = A ] && dir=$base
          (cd "$dir" && run "gaps-$side$r" "${GAPS_S:-150}" python3 bench/gaps.py ${GAPS_ARGS:-} \
            && cp bench/results/gaps.json "$OUT/gaps_$side$r.json")
          [ -f "$OUT/gaps_$side$r.json" ] && specs+=("$side=$OUT/gaps_$side$r.json")
        done
      done
      TAIL=60 run gaps-ab 30 python3 bench/gaps.py --compare "${specs[@]}" ;;
    anatomy) run anatomy "${ANATOMY_S:-150}" python3 bench/anatomy.py ${ANATOMY_ARGS:-}; keep anatomy.json ;;
    # every 7B and draft graph at LAUNCH_BATCHES (default 1 8): nodes, replay() host us, and under
    # the profiler when the GPU starts and ends it against the launch call (bench/launch_probe.py)
    launch-probe) run launch-probe "${LAUNCH_S:-200}" python3 bench/launch_probe.py --batches ${LAUNCH_BATCHES:-1 8}
                  keep launch_probe.json ;;
    # two GPUs (nvidia-h200-x2): the tensor-parallel tests, the all-reduce paths, TP=2 against TP=1
    tests-tp) run tests-tp "${TP_TESTS_S:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
                tests/gpu/test_collectives_gpu.py tests/gpu/test_tensor_parallel_gpu.py ;;
    allreduce) run allreduce "${ALLREDUCE_S:-120}" python3 bench/allreduce.py; keep allreduce.json ;;
    anatomy-tp) run anatomy-tp "${ANATOMY_TP_S:-330}" python3 bench/anatomy.py --batches 1 8 --steps 24 \
                  --tensor-parallel ${ANATOMY_TP:-1 2 2:nccl}; keep anatomy_tp.json ;;
    timeline) run timeline "${TIMELINE_S:-150}" python3 bench/timeline.py --replays 5 \
                --kernel-sets ${TIMELINE_SETS:-default no_norm} ${TIMELINE_ARGS:-}; keep timeline.json ;;
    wakeup) run wakeup "${WAKEUP_S:-120}" python3 bench/wakeup.py ${WAKEUP_ARGS:-}; keep wakeup.json ;;
    hostpath) run hostpath "${HOSTPATH_S:-240}" python3 bench/hostpath.py; keep hostpath.json ;;
    attention-loops) run attention-loops "${LOOPS_S:-150}" python3 bench/attention_loops.py; keep attention_loops.json ;;
    attention-grid) run attention-grid "${GRID_S:-150}" python3 bench/attention_grid.py; keep attention_grid.json ;;
    *) echo "unknown stage $s" | tee -a "$log" ;;
  esac
done
