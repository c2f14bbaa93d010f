"""Where a model server runs its engine calls: steps with prompts on the engine thread (the event loop
stays free for health checks), decode and verify steps inline on the loop's thread (no thread
hand-offs), and never two calls at once, whichever threads they run on."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from prometheus_client import CollectorRegistry

from protos import specdec_pb2 as pb
from protos.wire import pack_ids
from specdec.config import EngineConfig
from specdec.engine import TargetEngine
from specdec.metrics import ServerMetrics
from specdec.serving.owners import Connection
from specdec.serving.server import EngineRuntime
from specdec.serving.servicer import runs_inline
from target_server.servicer import TargetServicer
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.helpers.tiny_models import make_pair


def fake_engine(device: str = "cpu"):
    profile = SimpleNamespace(costs=SimpleNamespace(subscribe=lambda fn: None), on_sample=[])
    return SimpleNamespace(profile=profile, device=torch.device(device))


def runtime_with(engine) -> EngineRuntime:
    runtime = EngineRuntime(ServerMetrics(CollectorRegistry(), "target"))
    runtime.attach(engine)
    return runtime


def recorder():
    """(call, log): call(name, seconds) sleeps and logs (name, thread, calls running at its start)."""
    running, log = [], []

    def call(name, seconds):
        running.append(name)
        log.append((name, threading.current_thread().name, len(running)))
        time.sleep(seconds)
        running.remove(name)
        return name
    return call, log


def test_inline_and_executor_calls_never_overlap():
    runtime = runtime_with(fake_engine())
    call, log = recorder()

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


def test_a_cancelled_caller_keeps_the_engine_until_its_call_ends():
    """A client that goes away while its step runs on the engine thread: the step runs on, and
    the next call (inline) waits for it instead of running beside it."""
    runtime = runtime_with(fake_engine())
    call, log = recorder()

    async def main():
        slow = asyncio.create_task(runtime.call(call, "prompt", 0.2))
        await asyncio.sleep(0.02)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert await runtime.call(call, "decode", 0.0, inline=True) == "decode"

    asyncio.run(main())
    assert [(name, overlap) for name, _, overlap in log] == [("prompt", 1), ("decode", 1)]


def test_bare_cuda_device_attaches():
    # "cuda" without an index is the default device: nothing to make current (set_device refuses it).
    runtime_with(fake_engine("cuda"))


def test_which_requests_run_inline():
    decode = pb.VerifyRequest(seqs=[pb.VerifySeq(seq_id=i, new_tokens=pack_ids([3]),
                                                 draft_tokens=pack_ids([1, 2, 3, 4])) for i in range(32)])
    prompt = pb.VerifyRequest(seqs=[pb.VerifySeq(seq_id=1, new_tokens=pack_ids([3, 4, 5]))])
    sampled = pb.VerifyRequest(seqs=[pb.VerifySeq(
        seq_id=1, new_tokens=pack_ids([3]), draft_tokens=pack_ids([1, 2, 3, 4]),
        draft_probs=pb.Probs(encoding=pb.PROBS_ENCODING_DENSE_FP16, rows=4, vocab_size=32000,
                             values=bytes(4 * 32000 * 2)))])
    draft = pb.ProposeRequest(seqs=[pb.DraftSeq(seq_id=1, keep=4, new_tokens=pack_ids([7, 8]), num_draft=4)])
    assert runs_inline(decode) and runs_inline(draft)
    assert not runs_inline(prompt) and not runs_inline(sampled)


def test_prompt_steps_run_on_the_engine_thread_and_decode_steps_inline(tmp_path):
    target_path, _ = make_pair(tmp_path)
    engine = TargetEngine(EngineConfig(model=target_path, num_blocks=32, block_size=4,
                                       warmup_batch_sizes=(1,), max_num_draft=4))
    runtime = runtime_with(engine)
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
        return [r async for r in servicer._steps(requests(), Connection(runtime.owners))]

    responses = asyncio.run(main())
    assert [r.step for r in responses] == [1, 2]
    assert all(not r.HasField("error") for resp in responses for r in resp.results)
    assert threads[0].startswith("engine") and threads[1] == "MainThread"
    # Each answered step was accounted for after it was sent (the rpc histogram saw both).
    assert runtime.metrics._child("specdec_rpc_seconds", role="target", rpc="Verify")._sum.get() > 0
    assert engine.release([1]) == 1


if __name__ == "__main__":
    pytest.main([__file__])
