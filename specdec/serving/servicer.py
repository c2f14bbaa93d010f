"""What the Draft and Target servicers do the same way: the bidi step loop, Info and Release, and
the server's metrics of each step. Subclasses only convert one step's pb request into an engine
call and back (`_step`) and say which forwards it ran (`_observe_forwards`)."""
from __future__ import annotations

import logging
import time

import grpc

from protos import specdec_pb2 as pb
from specdec import trace
from specdec.serving import convert
from specdec.serving.owners import Connection
from specdec.serving.server import EngineRuntime

log = logging.getLogger(__name__)
_CODE_NAMES = {s.value[0]: s.name for s in grpc.StatusCode}
# Steps whose sequences each bring at most this many new token ids (decode and verify steps: the
# target's last token, the draft's correction plus the last draft) and whose request is small run
# inline on the event loop; steps with prompts, or with draft distributions to decode (a
# sampled verify carries k x vocabulary weights per sequence), run on the engine thread, so that
# health checks are answered meanwhile.
INLINE_MAX_NEW_TOKENS = 2
INLINE_MAX_REQUEST_BYTES = 64 << 10


def runs_inline(request) -> bool:
    return (all(len(s.new_tokens) <= 4 * INLINE_MAX_NEW_TOKENS for s in request.seqs)  # int32 ids
            and request.ByteSize() <= INLINE_MAX_REQUEST_BYTES)


class ModelServicer:
    rpc_name = ""  # "Propose" or "Verify"
    request_cls = None  # pb.ProposeRequest or pb.VerifyRequest (the step channel parses frames as it)

    def __init__(self, runtime: EngineRuntime):
        self.runtime = runtime

    async def _steps(self, request_iterator, connection: Connection):
        # One step at a time per stream (the next request is read after the answer is written);
        # several streams may be open, and their steps queue for the engine. Errors and the RPC
        # time are counted before the answer goes out; the rest of the step's metrics after it,
        # while the coordinator is busy with it (and also when the stream ends right there).
        # `connection` counts the stream for its coordinator (owners.py); the caller closes it.
        runtime = self.runtime
        async for request in request_iterator:
            received = time.perf_counter()
            connection.step(request)
            response, decode_seconds = await runtime.call(self._timed_step, request, received,
                                                          inline=runs_inline(request))
            if request.release:
                runtime.owners.released(request.release)
            self._count(response)
            runtime.busy_poll.kick()
            try:
                yield response
            finally:
                try:
                    await runtime.call(self._account, request, response, decode_seconds, inline=True)
                except Exception:  # the answer is out: a metrics failure must not end the stream
                    log.exception("recording the metrics of step %d failed", request.step)

    async def _stream(self, request_iterator, context):
        """The gRPC step stream (Propose / Verify): counted for its coordinator until the RPC
        ends, however it ends (a coordinator killed mid-stream cancels it)."""
        connection = Connection(self.runtime.owners)
        context.add_done_callback(lambda _: connection.close())
        try:
            async for response in self._steps(request_iterator, connection):
                yield response
        finally:
            connection.close()

    def _timed_step(self, request, received: float):
        """(_step's response, seconds of the step's single-token forwards)."""
        self.runtime.decode_seconds = 0.0
        if trace.enabled:
            trace.begin_step(self.rpc_name, request.step)
        try:
            response = self._step(request, received)
        finally:
            if trace.enabled:
                trace.begin_step(None)
        return response, self.runtime.decode_seconds

    def _count(self, response) -> None:
        """The step's per-sequence errors and its handling time (no engine state read)."""
        metrics = self.runtime.metrics
        for r in response.results:
            if r.HasField("error") and r.error.code:
                metrics.count_error(_CODE_NAMES.get(r.error.code, "UNKNOWN"))
        metrics.observe_rpc(self.rpc_name, response.timing.step_seconds)

    def _account(self, request, response, decode_seconds: float) -> None:
        """The rest of an answered step's metrics: forward histograms and the KV / sequence gauges
        (engine state, so an engine call; scrapes read the gauges meanwhile)."""
        self._observe_forwards(request, response, decode_seconds)
        self.runtime.publish_state()

    def _step(self, request, received: float):
        raise NotImplementedError

    def _observe_forwards(self, request, response, decode_seconds: float) -> None:
        """Forward-time histogram entries of the step's forwards that were not single-token decode
        forwards (those arrive through the engine's profile, EngineRuntime.attach, and sum to
        decode_seconds)."""
        raise NotImplementedError

    @staticmethod
    def _served(request, response) -> list:
        """The request's sequences that the engine ran (no per-sequence error)."""
        return [s for s, r in zip(request.seqs, response.results) if not r.HasField("error")]

    @staticmethod
    def _finish_timing(step_timing, request, received: float) -> pb.StepTiming:
        timing = convert.timing_to_pb(step_timing)
        timing.batch_size = len(request.seqs)
        timing.engine_seconds = step_timing.step_seconds   # the engine's call; step_seconds: the server's
        timing.step_seconds = time.perf_counter() - received
        return timing

    async def Info(self, request, context):
        t0 = time.perf_counter()
        info = await self.runtime.call(lambda: self.runtime.engine.info())
        self.runtime.metrics.observe_rpc("Info", time.perf_counter() - t0)
        message = convert.info_to_pb(info)
        message.step_port = self.runtime.step_port
        return message

    async def Release(self, request, context):
        t0 = time.perf_counter()

        released, free = await self.runtime.release(list(request.seq_ids))
        self.runtime.metrics.observe_rpc("Release", time.perf_counter() - t0)
        return pb.ReleaseResponse(released=released, kv_blocks_free=free)
