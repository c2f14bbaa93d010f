"""specdec.v1.Target: pb <-> TargetEngine for one step; the rest is the shared ModelServicer."""
from __future__ import annotations

from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec import trace
from specdec.serving import convert
from specdec.serving.server import EngineRuntime
from specdec.serving.servicer import ModelServicer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Target"].full_name


def verify(engine, request: pb.VerifyRequest) -> tuple[pb.VerifyResponse, object]:
    """One Verify step on the engine: (the response without timing, the engine's StepResult)."""
    prepared = convert.verify_seqs_from_pb(request, engine.vocab_size, engine.config.max_num_draft)
    if trace.enabled:
        trace.mark_step("s_engine")
    step = engine.verify([p for p in prepared if not isinstance(p, convert.SeqError)],
                         list(request.release))
    if trace.enabled:
        trace.mark_step("s_engined")
    outputs = convert.merge(prepared, step.outputs)
    results = [convert.verify_result_to_pb(s.seq_id, o) for s, o in zip(request.seqs, outputs)]
    return pb.VerifyResponse(step=request.step, results=results), step


def expected_next(request: pb.VerifyRequest, response: pb.VerifyResponse) -> list[tuple[int, int, int]]:
    """The step that usually follows an answered one, for TargetEngine.prepare_ahead: per sequence
    (seq_id, the target's next token, the most drafts any sequence of this step had: a sequence
    that just joined, or decoded plainly beside drafting ones, then fits too, as fewer drafts than
    staged do); none when any sequence failed, was a partial prefill or samples (the next step's
    prompt chunk or draft weights are not known ahead)."""
    out = []
    k = 0
    for s, r in zip(request.seqs, response.results):
        if r.HasField("error") or s.partial_prefill or r.next_token < 0 or s.sampling.temperature > 0:
            return []
        out.append((s.seq_id, r.next_token))
        k = max(k, len(s.draft_tokens) // 4)   # int32 ids
    return [(seq_id, token, k) for seq_id, token in out]


class TargetServicer(ModelServicer, pb_grpc.TargetServicer):
    rpc_name = "Verify"
    request_cls = pb.VerifyRequest

    async def Verify(self, request_iterator, context):
        async for response in self._stream(request_iterator, context):
            yield response

    def _step(self, request: pb.VerifyRequest, received: float) -> pb.VerifyResponse:
        response, step = verify(self.runtime.engine, request)
        response.timing.CopyFrom(self._finish_timing(step.timing, request, received))
        return response

    def _account(self, request: pb.VerifyRequest, response: pb.VerifyResponse, decode_seconds: float) -> None:
        super()._account(request, response, decode_seconds)
        engine = self.runtime.engine
        if engine.config.verify_ahead and len(response.results) == len(request.seqs):
            # The answer is out: the next step's admission and staging while the coordinator and
            # the draft work (after the gauges, which so do not count its reservation).
            engine.prepare_ahead(expected_next(request, response))

    def _observe_forwards(self, request: pb.VerifyRequest, response: pb.VerifyResponse,
                          decode_seconds: float) -> None:
        # One forward per step. All single-token (plain decoding): the engine's profile already
        # took it. Any prompt tokens: prefill. Otherwise a verify over 1 + k tokens per sequence,
        # which also moves the profile entry of (batch, k + 1) when every sequence has the same k.
        timing = response.timing
        served = self._served(request, response)
        if not timing.num_forwards or not served:
            return
        lens = [(len(s.new_tokens) + len(s.draft_tokens)) // 4 for s in served]  # int32 ids
        if max(lens) == 1:
            return
        if any(len(s.new_tokens) > 4 or s.partial_prefill for s in served):
            self.runtime.metrics.observe_forward("prefill", len(served), timing.forward_seconds)
            return
        self.runtime.metrics.observe_forward("verify", len(served), timing.forward_seconds)
        if min(lens) == max(lens) and not self.runtime.engine.ran_staged_shape:
            self.runtime.engine.profile.costs.update(len(served), lens[0], timing.forward_seconds)


def add_to_server(server, runtime: EngineRuntime) -> TargetServicer:
    servicer = TargetServicer(runtime)
    pb_grpc.add_TargetServicer_to_server(servicer, server)
    return servicer
