"""specdec.v1.Draft: pb <-> DraftEngine for one step; the rest is the shared ModelServicer."""
from __future__ import annotations

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec import trace
from specdec.serving import convert
from specdec.serving.server import EngineRuntime
from specdec.serving.servicer import ModelServicer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Draft"].full_name


def propose(engine, request: pb.ProposeRequest) -> tuple[pb.ProposeResponse, object]:
    """One Propose step on the engine: (the response without timing, the engine's StepResult)."""
    prepared = convert.draft_seqs_from_pb(request)
    if trace.enabled:
        trace.mark_step("s_engine")
    step = engine.propose([p for p in prepared if not isinstance(p, convert.SeqError)],
                          list(request.release))
    if trace.enabled:
        trace.mark_step("s_engined")
    outputs = convert.merge(prepared, step.outputs)
    results = [convert.draft_result_to_pb(s.seq_id, o, engine.config.probs_dtype)
               for s, o in zip(request.seqs, outputs)]
    return pb.ProposeResponse(step=request.step, results=results), step


class DraftServicer(ModelServicer, pb_grpc.DraftServicer):
    rpc_name = "Propose"
    request_cls = pb.ProposeRequest

    async def Propose(self, request_iterator, context):
        async for response in self._stream(request_iterator, context):
            yield response

    def _step(self, request: pb.ProposeRequest, received: float) -> pb.ProposeResponse:
        response, step = propose(self.runtime.engine, request)
        response.timing.CopyFrom(self._finish_timing(step.timing, request, received))
        return response

    def _observe_forwards(self, request: pb.ProposeRequest, response: pb.ProposeResponse,
                          decode_seconds: float) -> None:
        # The step's first forward feeds what each sequence's KV lacks: a prompt (prefill), or the
        # target's token (plus the last draft after a full acceptance). Later forwards feed one
        # drafted token per sequence and come in through the engine's profile; the first one's
        # time is what remains of the step's forward time.
        timing = response.timing
        served = self._served(request, response)
        if not timing.num_forwards or not served:
            return
        prompt = any(len(s.new_tokens) > 4 for s in served)  # more than one int32 token id
        first = max(timing.forward_seconds - decode_seconds, 0.0)
        self.runtime.metrics.observe_forward("prefill" if prompt else "decode", len(served), first)


def add_to_server(server, runtime: EngineRuntime) -> DraftServicer:
    servicer = DraftServicer(runtime)
    pb_grpc.add_DraftServicer_to_server(servicer, server)
    return servicer
