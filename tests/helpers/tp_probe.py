"""Device diagnostic of tensor parallelism, phase by phase with timestamps (not a test):

    python3 tests/helpers/tp_probe.py [--dtype float32] [--no-graphs] [--hang-dump-s 120]

A tiny model pair is written, a one-GPU TargetEngine decodes greedily, then a two-rank one
(serving/tensor_parallel.py) warms up and decodes the same prompts; every process dumps its Python
stacks after --hang-dump-s seconds (SPECDEC_TP_HANG_DUMP_S), so a hang shows where it waits."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from specdec.config import EngineConfig  # noqa: E402
from specdec.engine import TargetEngine  # noqa: E402
from specdec.serving import tensor_parallel  # noqa: E402
from tests.helpers.tiny_models import make_pair  # noqa: E402
from tests.unit.test_engines import PROMPTS, plain_greedy  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--hang-dump-s", type=float, default=120)
    a = p.parse_args()
    os.environ["SPECDEC_TP_HANG_DUMP_S"] = str(a.hang_dump_s)
    faulthandler.dump_traceback_later(a.hang_dump_s, exit=False)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(processName)s %(name)s: %(message)s")
    log = logging.getLogger("tp_probe")
    dtype = getattr(torch, a.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        target_path, _ = make_pair(Path(tmp))

        def config(**kw):
            return EngineConfig(model=target_path, device="cuda:0" if torch.cuda.is_available() else "cpu", dtype=dtype, num_blocks=256, block_size=16,
                                warmup_batch_sizes=(1, 2, 4), cuda_graphs=not a.no_graphs, **kw)
        t0 = time.perf_counter()
        one = TargetEngine(config())
        one.warm_up()
        reference = plain_greedy(one, PROMPTS, 8)
        log.info("one GPU: %.1fs", time.perf_counter() - t0)
        t0 = time.perf_counter()
        tp = tensor_parallel.start(TargetEngine, config(tensor_parallel_size=2))
        log.info("two ranks built: %.1fs", time.perf_counter() - t0)
        try:
            tp.warm_up()
            log.info("two ranks warmed up: %.1fs", time.perf_counter() - t0)
            got = plain_greedy(tp, PROMPTS, 8)
            log.info("two ranks decoded: %.1fs; equal to one GPU: %s", time.perf_counter() - t0, got == reference)
        finally:
            tp.close()
        log.info("closed: %.1fs", time.perf_counter() - t0)
    faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
