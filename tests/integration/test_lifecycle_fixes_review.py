"""Review of the lifecycle fixes (716887d..): servers free a dead coordinator's sequences
(specdec/serving/owners.py), Coordinator.check_target re-reads a target that closed its step
connection while the coordinator was idle.

In-process (a tiny TargetEngine on the CPU, the real EngineRuntime / TargetServicer / Owners, the real
Coordinator and ModelServer), so each test takes about a second.

Bugs found, each fixed (the tests below failed before): 1 by dropping a sequence's owner only once the
engine freed it (EngineRuntime.release, ModelServicer._steps); 2 and 3 by ModelServer.needs_info (a
failure or an ended connection since the last answered Info, until one is answered):
1. A sequence stops being its coordinator's as soon as a request *names* it for release (a step's
   `release` field, or a Release call), before the engine has freed it. A release that never reaches
   the engine (its call cancelled while it waits for the engine: a Release past its deadline, the
   coordinator's shutdown Release of 2 s among them, or a step stream cancelled because the
   coordinator died) leaves the KV held and owned by nobody: never freed, whatever the orphan timeout.
2. Coordinator.check_target reads the target afresh once per ended connection, and counts a failed
   Info as that once: a request that arrives while the target is still down / loading (and takes no
   step: refused at validation, a client gone) uses it up, and the target back with other limits is
   never read afresh; requests it cannot hold are then admitted, stream, and fail mid-way.
3. A target lost during a step and not back within --connect-timeout: the failed step reset the
   connection (ModelServer._call None), so the ended-connection check never saw it; the target back with
   other limits is never read afresh either (the next step over a new connection succeeds).
"""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from coordinator.app import Coordinator
from coordinator.config import CoordinatorConfig
from coordinator.servers import ModelServer
from coordinator.tokenizer import TextTokenizer
from protos import specdec_pb2 as pb
from protos.wire import pack_ids
from specdec.config import EngineConfig
from specdec.engine import TargetEngine
from specdec.metrics import CoordinatorMetrics, ServerMetrics
from specdec.serving.owners import Connection
from specdec.serving.server import EngineRuntime
from target_server.servicer import TargetServicer
from tests.helpers.threads import one_thread  # noqa: F401  (autouse: single-threaded)
from tests.helpers.tiny_models import _tokenizer_json, make_pair

ORPHAN_S = 0.1
OWNER = 0x1234
BUSY_S = 0.3   # another coordinator's long step holding the engine


# --- the server side: owners.py and EngineRuntime ------------------------------------------------
@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    target, _ = make_pair(tmp_path_factory.mktemp("models"))
    return target


def _runtime(target_path) -> tuple[EngineRuntime, TargetEngine, TargetServicer]:
    engine = TargetEngine(EngineConfig(model=target_path, num_blocks=32, block_size=4,
                                       warmup_batch_sizes=(1,), max_num_draft=4))
    runtime = EngineRuntime(ServerMetrics(CollectorRegistry(), "target"), orphan_timeout_s=ORPHAN_S)
    runtime.attach(engine)
    return runtime, engine, TargetServicer(runtime)


def _first_step(seq_id: int) -> pb.VerifyRequest:
    return pb.VerifyRequest(step=1, owner=OWNER, seqs=[pb.VerifySeq(seq_id=seq_id, new_tokens=pack_ids([5, 17, 42, 7]),
                                                                   first=True)])


async def _start_sequence(servicer: TargetServicer, connection: Connection, seq_id: int) -> None:
    async def one():
        yield _first_step(seq_id)
    responses = [r async for r in servicer._steps(one(), connection)]
    assert not responses[0].results[0].HasField("error")


class _Context:
    """The part of grpc.aio.ServicerContext that _stream uses."""

    def __init__(self):
        self.callbacks = []

    def add_done_callback(self, cb):
        self.callbacks.append(cb)

    def end(self):
        for cb in self.callbacks:
            cb(self)


def test_control_a_dead_coordinators_sequence_is_freed(target_path):
    """(Works) The coordinator's stream ends with its sequence held: freed after the timeout."""
    runtime, engine, servicer = _runtime(target_path)

    async def main():
        connection = Connection(runtime.owners)
        await _start_sequence(servicer, connection, 1)
        held = engine.num_sequences()
        connection.close()
        await asyncio.sleep(ORPHAN_S * 5)
        return held, engine.num_sequences()
    assert asyncio.run(main()) == (1, 0)


def test_a_release_cancelled_while_the_engine_is_busy_still_lets_the_orphan_timeout_free_it(target_path):
    runtime, engine, servicer = _runtime(target_path)

    async def main():
        connection = Connection(runtime.owners)
        await _start_sequence(servicer, connection, 1)
        # Another coordinator's long step holds the engine; this coordinator shuts down: its Release
        # waits for the engine, passes its deadline (gRPC cancels the handler), the coordinator exits.
        busy = asyncio.ensure_future(runtime.call(time.sleep, BUSY_S))
        await asyncio.sleep(0.02)
        release = asyncio.ensure_future(servicer.Release(pb.ReleaseRequest(seq_ids=[1]), None))
        await asyncio.sleep(0.02)
        release.cancel()
        connection.close()
        await busy
        await asyncio.sleep(ORPHAN_S * 5)
        return engine.num_sequences()
    assert asyncio.run(main()) == 0   # (1, held for good, before the fix)


def test_a_step_cancelled_before_it_ran_leaves_its_released_sequences_to_the_orphan_timeout(target_path):
    runtime, engine, servicer = _runtime(target_path)

    async def main():
        first = Connection(runtime.owners)
        await _start_sequence(servicer, first, 1)
        first.close()   # (a reopened stream: the coordinator's next step goes on another one)
        context = _Context()

        async def requests():
            # Sequence 1 finished: the next step releases it.
            yield pb.VerifyRequest(step=2, owner=OWNER, release=[1])
            await asyncio.Event().wait()
        busy = asyncio.ensure_future(runtime.call(time.sleep, BUSY_S))
        await asyncio.sleep(0.02)

        async def stream():
            async for _ in servicer._stream(requests(), context):
                pass
        task = asyncio.ensure_future(stream())
        await asyncio.sleep(0.02)   # the step waits for the engine
        assert engine.num_sequences() == 1
        task.cancel()               # the coordinator is killed: gRPC cancels the stream's handler
        context.end()
        await asyncio.gather(task, return_exceptions=True)
        await busy
        await asyncio.sleep(ORPHAN_S * 5)
        return engine.num_sequences()
    assert asyncio.run(main()) == 0   # (1, held for good, before the fix)


# --- the coordinator side: check_target ------------------------------------------------------------
V = 320


def _info(blocks: int) -> pb.ModelInfo:
    return pb.ModelInfo(vocab_size=V, max_model_len=512, kv_blocks_total=blocks, block_size=16)


class _EndedCall:
    """A step connection the server closed (ModelServer._call after the target went away)."""

    def done(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


def _down(*_, **__):
    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               "failed to connect to all addresses")


def _coordinator(tmp_path, **kw) -> tuple[Coordinator, ModelServer]:
    path = tmp_path / "tokenizer.json"
    path.write_text(_tokenizer_json(V))
    target = ModelServer("target", "127.0.0.1:1", step_channel=False)
    coord = Coordinator(CoordinatorConfig(target="127.0.0.1:1", **kw), TextTokenizer(path), target, None,
                        _info(1000), None, CoordinatorMetrics(CollectorRegistry()))
    return coord, target


def test_control_a_target_restarted_while_idle_is_read_afresh(tmp_path):
    """(Works) The target's step connection ended while idle, the target is back with 8 blocks."""
    async def main():
        coord, target = _coordinator(tmp_path)
        target._call = _EndedCall()

        async def back(timeout=5.0):
            return _info(8)
        target.info = back
        await coord.check_target()
        await target.close()
        return coord.scheduler.target.blocks_total
    assert asyncio.run(main()) == 8


def test_a_target_still_down_at_the_first_request_is_read_afresh_once_back(tmp_path):
    async def main():
        coord, target = _coordinator(tmp_path)
        target._call = _EndedCall()     # the target restarted while the coordinator was idle
        target.info = _down             # still loading when the next request comes
        await coord.check_target()      # that request is refused at validation: no step follows

        async def back(timeout=5.0):
            return _info(8)
        target.info = back              # back, with 8 blocks
        await coord.check_target()      # the next request's admission
        await target.close()
        return coord.scheduler.target.blocks_total, coord.limits.max_model_len
    assert asyncio.run(main())[0] == 8   # 1000 on the current code: admitted, then fails mid-stream


def test_a_target_back_after_the_connect_timeout_is_read_afresh(tmp_path):
    async def main():
        coord, target = _coordinator(tmp_path, connect_timeout_s=0.3)
        target._call = _EndedCall()
        target.info = _down
        # A request's step finds the target gone: the step fails (ModelServer resets its call),
        # the loop waits --connect-timeout for it, then ends the request with UNAVAILABLE.
        with pytest.raises(Exception):
            await target.step(pb.VerifyRequest(step=1), timeout=1.0)
        await coord.loop._target_lost([], "target server failed")

        async def back(timeout=5.0):
            return _info(8)
        target.info = back              # back later, with 8 blocks
        await coord.check_target()      # the next request's admission
        await target.close()
        return coord.scheduler.target.blocks_total
    assert asyncio.run(main()) == 8   # 1000 on the current code
