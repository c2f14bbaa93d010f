"""The Generation servicer (pb <-> coordinator objects) and the coordinator's gRPC server, with
health checking and reflection."""
from __future__ import annotations

import asyncio
import logging
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from coordinator.app import Coordinator
from coordinator.config import CoordinatorConfig
from coordinator.scheduler import Rejected
from coordinator.sequence import Abort, Sequence
from coordinator.servers import status_from_code
from coordinator.validation import InvalidRequest, validate_async
from protos import specdec_pb2 as pb
from protos import specdec_pb2_grpc as pb_grpc
from specdec.metrics import CoordinatorMetrics, start_metrics_server
from specdec.serving.errors import ErrorInterceptor

log = logging.getLogger("specdec.coordinator")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name


class _Ended(Exception):
    """The call ended on the client's side (its deadline passed, or it went away) before a refusal
    could go out: gRPC refuses the abort, and there is nobody to tell."""


async def _abort(context: grpc.aio.ServicerContext, status: grpc.StatusCode, message: str) -> None:
    """context.abort (which raises AbortError once the status is out), or _Ended where the call
    is over already (gRPC raises an error of its own then, which is no failure of the request's)."""
    try:
        await context.abort(status, message)
    except grpc.aio.AbortError:
        raise
    except Exception:
        if not context.done():
            raise
        raise _Ended from None


def _client_end(context: grpc.aio.ServicerContext) -> str:
    """How a call that the client ended ended: DEADLINE_EXCEEDED once its deadline has passed, else
    CANCELLED (the client cancelled, or went away)."""
    left = context.time_remaining()
    return "DEADLINE_EXCEEDED" if left is not None and left <= 0 else "CANCELLED"


def _usage(seq: Sequence) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(seq.params.prompt_ids), completion_tokens=len(seq.output),
                    draft_tokens=seq.drafted, accepted_tokens=seq.accepted, steps=seq.steps)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, coord: Coordinator | None, metrics: CoordinatorMetrics | None = None, waiting: str = ""):
        """coord None: the coordinator is still waiting for its servers (`waiting` says for which);
        calls are refused with UNAVAILABLE until `coord` is set."""
        self.coord = coord
        self.metrics = metrics if metrics is not None else coord.metrics
        self.waiting = waiting

    async def _refuse_waiting(self, context) -> None:
        self.metrics.observe_request("UNAVAILABLE", 0.0, 0, None)
        try:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, self.waiting)
        except _Ended:
            pass

    async def Generate(self, request, context):
        if self.coord is None:
            await self._refuse_waiting(context)
            return
        # Request metrics as the client sees them: from the call's arrival to each chunk handed to
        # gRPC, and the status the call ends with (CANCELLED or DEADLINE_EXCEEDED: the client
        # ended it first, _client_end).
        coord, metrics = self.coord, self.coord.metrics
        arrival = time.perf_counter()
        code, ttft, seq, ended = None, None, None, False
        try:
            await coord.check_target()
            try:
                params = await validate_async(request, coord.limits, coord.tokenizer)
            except InvalidRequest as e:
                code = "INVALID_ARGUMENT"
                await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            if coord.failure is not None:
                code = "UNAVAILABLE"
                await _abort(context, grpc.StatusCode.UNAVAILABLE, coord.failure)
            seq = coord.new_sequence(params)
            try:
                coord.scheduler.submit(seq)
            except Rejected as e:
                code = "RESOURCE_EXHAUSTED"
                await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            while True:
                item = await seq.queue.get()
                if isinstance(item, Abort):
                    ended, code = True, status_from_code(item.code).name
                    await _abort(context, status_from_code(item.code), item.message)
                if ttft is None and item.token_ids:
                    ttft = time.perf_counter() - arrival
                    metrics.observe_first_token(ttft)
                response = pb.GenerateResponse(text=item.text, token_ids=item.token_ids,
                                               request_id=params.request_id)
                if item.finish is not None:
                    ended, code = True, "OK"
                    response.finish_reason = int(item.finish)
                    response.usage.CopyFrom(_usage(seq))
                yield response
                if ended:
                    return
        except _Ended:
            code = None   # the refusal found the call over: the client's end is its status
        except Exception:
            if code is None:   # a failure of ours: the interceptor answers INTERNAL
                code = "INTERNAL"
            raise
        finally:
            # The client went away (cancel, deadline) before the end: free the KV on both servers.
            if seq is not None and not ended:
                coord.scheduler.cancel(seq)
            if code is None:
                code = _client_end(context)
            metrics.observe_request(code, time.perf_counter() - arrival,
                                    len(seq.output) if seq is not None else 0, ttft)

    async def Info(self, request, context):
        coord = self.coord
        if coord is None:
            await self._refuse_waiting(context)
            return None
        info = pb.GenerationInfo(default_num_draft=coord.config.num_draft,
                                 max_batch_size=coord.config.max_batch_size)
        try:
            info.target.CopyFrom(await coord.target.info(timeout=2.0))
        except grpc.aio.AioRpcError:
            info.target.CopyFrom(coord.target_info)
        if coord.draft is not None and coord.draft_up:
            try:
                info.draft.CopyFrom(await coord.draft.info(timeout=2.0))
            except grpc.aio.AioRpcError:
                pass
        return info


async def build_server(service: GenerationService, address: str) -> tuple[grpc.aio.Server, int, health.aio.HealthServicer]:
    """The gRPC server of `service`, bound (not started); health NOT_SERVING until the caller
    sets it."""
    # The servers' interceptor: an exception escaping Generate, or bytes that are not a request,
    # get a status (INTERNAL / INVALID_ARGUMENT) and a log line instead of UNKNOWN and a traceback.
    server = grpc.aio.server(interceptors=[ErrorInterceptor(prefix=f"/{SERVICE_NAME}/",
                                                            on_error=service.metrics.count_error)],
                             options=[("grpc.so_reuseport", 0)])   # (see the model servers' SERVER_OPTIONS)
    pb_grpc.add_GenerationServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as e:   # (in use, or not an address of this host)
        raise OSError(f"cannot listen on {address}: {e}") from None
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)
    return server, port, health_servicer


async def _set_health(servicer: health.aio.HealthServicer, status) -> None:
    for name in ("", SERVICE_NAME):
        await servicer.set(name, status)


async def serve(config: CoordinatorConfig, metrics: CoordinatorMetrics) -> None:
    # /metrics first: Prometheus sees the coordinator up while it waits for the servers.
    metrics_server = start_metrics_server(config.metrics_port, metrics.registry) \
        if config.metrics_port >= 0 else None
    if metrics_server is not None:
        log.info("coordinator metrics on port %d", metrics_server.port)
    try:
        await _serve(config, metrics)
    finally:
        if metrics_server is not None:
            metrics_server.close()


async def _serve(config: CoordinatorConfig, metrics: CoordinatorMetrics) -> None:
    # The port first (a port in use fails at once; health answers NOT_SERVING and calls get
    # UNAVAILABLE saying what it waits for), then the servers, then SERVING.
    service = GenerationService(None, metrics, waiting=f"the coordinator is waiting for its servers (target "
                                                       f"{config.target}, draft {config.draft or 'none'})")
    server, port, health_servicer = await build_server(service, config.address)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    connecting = asyncio.ensure_future(Coordinator.connect(config, metrics))
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopped = not connecting.done()
    if stopped or connecting.exception() is not None:   # stopped, or the servers failed
        connecting.cancel()
        stopping.cancel()
        await server.stop(0)
        if stopped:
            log.info("stopped while waiting for the servers")
            return
        await connecting   # (raises why it failed)
    coord = service.coord = connecting.result()

    async def not_serving(message: str) -> None:
        await _set_health(health_servicer, health_pb2.HealthCheckResponse.NOT_SERVING)

    coord.start(on_failure=not_serving)
    await _set_health(health_servicer, health_pb2.HealthCheckResponse.SERVING)
    log.info("coordinator listening on port %d (target %s, draft %s)", port, config.target,
             config.draft or "none")
    await stopping
    log.info("shutting down (grace %.0fs)", config.grace_s)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.grace_s)
    await coord.close()
