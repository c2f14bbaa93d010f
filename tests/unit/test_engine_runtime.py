"""Where a model server runs its engine calls: steps with prompts on the engine thread (the event loop
stays free for health checks), decode and verify steps inline on the loop's thread (no thread
hand-offs), and never two calls at once, whichever threads they run on."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from protos import specdec_pb2 as pb
from protos.wire import pack_ids
from specdec.config import EngineConfig
from specdec.engine import TargetEngine
from specdec.metrics import ServerMetrics
from specdec.serving.server import EngineRuntime
from target_server.servicer import TargetServicer
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.helpers.tiny_models import make_pair


def fake_engine():
    profile = SimpleNamespace(costs=SimpleNamespace(subscribe=lambda fn: None), on_sample=[])
    return SimpleNamespace(profile=profile, device=SimpleNamespace(type="cpu"))


def test_inline_and_executor_calls_never_overlap():
    runtime = EngineRuntime(ServerMetrics(CollectorRegistry(), "target"))
    runtime.attach(fake_engine())
    running, log = [], []

    def call(name, seconds):
        running.append(name)
        log.append((name, threading.current_thread().name, len(running)))
        time.sleep(seconds)
        running.remove(name)
        return name

    async def main():
        slow = asyncio.create_task(runtime.call(call, "prompt", 0.2))
        await asyncio.sleep(0.02)  # the executor call is running now
        assert await runtime.call(call, "decode", 0.0, inline=True) == "decode"
        assert await slow == "prompt"

    asyncio.run(main())
    (first, first_thread, overlap1), (second, second_thread, overlap2) = log
    assert (first, second) == ("prompt", "decode")  # the inline call waited for the running one
    assert first_thread.startswith("engine") and second_thread == "MainThread"
    assert overlap1 == overlap2 == 1


def test_prompt_steps_run_on_the_engine_thread_and_decode_steps_inline(tmp_path):
    target_path, _ = make_pair(tmp_path)
    engine = TargetEngine(EngineConfig(model=target_path, num_blocks=32, block_size=4,
                                       warmup_batch_sizes=(1,), max_num_draft=4))
    runtime = EngineRuntime(ServerMetrics(CollectorRegistry(), "target"))
    runtime.attach(engine)
    servicer = TargetServicer(runtime)
    threads = []
    step = servicer._step

    def recording_step(request, received):
        threads.append(threading.current_thread().name)
        return step(request, received)
    servicer._step = recording_step

    async def requests():
        yield pb.VerifyRequest(step=1, seqs=[pb.VerifySeq(seq_id=1, new_tokens=pack_ids([5, 17, 42, 7]),
                                                         first=True)])
        yield pb.VerifyRequest(step=2, seqs=[pb.VerifySeq(seq_id=1, new_tokens=pack_ids([3]),
                                                         draft_tokens=pack_ids([9, 9]))])

    async def main():
        return [r async for r in servicer._steps(requests())]

    responses = asyncio.run(main())
    assert [r.step for r in responses] == [1, 2]
    assert all(not r.HasField("error") for resp in responses for r in resp.results)
    assert threads[0].startswith("engine") and threads[1] == "MainThread"
    # Each answered step was accounted for after it was sent (the rpc histogram saw both).
    assert runtime.metrics._child("specdec_rpc_seconds", role="target", rpc="Verify")._sum.get() > 0
    assert engine.release([1]) == 1


if __name__ == "__main__":
    pytest.main([__file__])
