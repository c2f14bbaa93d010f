"""Turns exceptions escaping a handler into a gRPC status, so no request can kill the server.
Torch-free: the coordinator uses the interceptor too."""
from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from protos.wire import InvalidInput
from specdec.block_manager import OutOfBlocks

log = logging.getLogger(__name__)


class NotReady(RuntimeError):
    """The model is still loading (UNAVAILABLE: the client retries)."""


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidInput):  # WireError, SamplingParamsError, ConfigError, ...
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, DecodeError):  # bytes that are not the request message
        return grpc.StatusCode.INVALID_ARGUMENT, f"request: not a valid message: {exc}"
    if isinstance(exc, OutOfBlocks):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, NotReady):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def _abort(context: grpc.aio.ServicerContext, exc: Exception, method: str,
                 on_error: Callable[[str], None] | None) -> None:
    code, message = status_of(exc)
    if on_error is not None:
        on_error(code.name)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    else:
        log.info("%s: %s %s", method, code.name, message)
    if not context.done():   # (over already, by its deadline or a cancel: gRPC would refuse the abort)
        await context.abort(code, message)


class _Undecodable:
    """What the tolerant deserializer returns for bytes that are not the request message."""

    def __init__(self, error: DecodeError):
        self.error = error


def _tolerant(deserializer: Callable | None) -> Callable | None:
    """A unary request is deserialized by gRPC before any handler runs, and a DecodeError there
    came back as UNKNOWN with an ERROR traceback in the log; this hands it to the handler, which
    answers INVALID_ARGUMENT. (A stream's messages are read inside the handler: status_of.)"""
    if deserializer is None:
        return None

    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as e:
            return _Undecodable(e)
    return deserialize


def _wrap_unary(behavior: Callable, method: str, on_error) -> Callable:
    async def handler(request, context):
        try:
            if isinstance(request, _Undecodable):
                raise request.error
            return await behavior(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort(context, e, method, on_error)
    return handler


def _wrap_stream(behavior: Callable, method: str, on_error) -> Callable:
    async def handler(request_or_iterator, context):
        try:
            if isinstance(request_or_iterator, _Undecodable):
                raise request_or_iterator.error
            async for response in behavior(request_or_iterator, context):
                yield response
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            await _abort(context, e, method, on_error)
    return handler


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the handlers of services under `prefix` (ours; health and reflection are left alone).
    on_error(status code name) is called for every failure turned into a status (the errors
    counter)."""

    def __init__(self, prefix: str = "/specdec.v1.", on_error: Callable[[str], None] | None = None):
        self.prefix = prefix
        self.on_error = on_error

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        unary_kw = {**kw, "request_deserializer": _tolerant(handler.request_deserializer)}
        m, on_error = details.method, self.on_error
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_wrap_unary(handler.unary_unary, m, on_error),
                                                       **unary_kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_wrap_unary(handler.stream_unary, m, on_error),
                                                        **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_wrap_stream(handler.unary_stream, m, on_error),
                                                        **unary_kw)
        return grpc.stream_stream_rpc_method_handler(_wrap_stream(handler.stream_stream, m, on_error),
                                                     **kw)
