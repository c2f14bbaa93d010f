"""What the Draft and Target servicers do the same way: the bidi step loop, Info and Release.
Subclasses only convert one step's pb request into an engine call and back (`_step`)."""
from __future__ import annotations

import time

from protos import specdec_pb2 as pb
from specdec.serving import convert
from specdec.serving.server import EngineRuntime


class ModelServicer:
    def __init__(self, runtime: EngineRuntime):
        self.runtime = runtime

    async def _steps(self, request_iterator):
        # One step at a time per stream (the next request is read after the answer is written);
        # several streams may be open, and their steps queue on the engine's one thread.
        async for request in request_iterator:
            yield await self.runtime.call(self._step, request, time.perf_counter())

    def _step(self, request, received: float):
        raise NotImplementedError

    @staticmethod
    def _finish_timing(step_timing, request, received: float) -> pb.StepTiming:
        timing = convert.timing_to_pb(step_timing)
        timing.batch_size = len(request.seqs)
        timing.step_seconds = time.perf_counter() - received
        return timing

    async def Info(self, request, context):
        return convert.info_to_pb(await self.runtime.call(lambda: self.runtime.engine.info()))

    async def Release(self, request, context):
        def release():
            engine = self.runtime.engine
            return engine.release(request.seq_ids), engine.num_free_blocks
        released, free = await self.runtime.call(release)
        return pb.ReleaseResponse(released=released, kv_blocks_free=free)
