"""A server interceptor that answers INVALID_ARGUMENT to a request body that is not valid protobuf.

grpcio (aio) deserializes the request before any handler or interceptor code runs, and when that
raises it answers UNKNOWN ("Unexpected DecodeError") — indistinguishable from a server bug, and not
what the protos document. Wrapping each unary-request handler's deserializer so a parse failure
becomes a marker, and the handler so the marker becomes INVALID_ARGUMENT with the parser's words,
keeps garbage from any client (fuzzers, a wrong proto version, a port scanner) a caller error.
Streaming-request handlers (only reflection) are left as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except DecodeError as e:
            return _Malformed(str(e) or "not a valid protobuf message")

    return parse


def _refuse(method: str, request: _Malformed) -> tuple[grpc.StatusCode, str]:
    return grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request body does not parse: {request.error}"


class ParseGuard(grpc.aio.ServerInterceptor):
    """Malformed request bodies get INVALID_ARGUMENT instead of grpcio's UNKNOWN."""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: Any
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = details.method
        kw = {
            "request_deserializer": _tolerant(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Malformed):
                    await context.abort(*_refuse(method, request))
                result = inner(request, context)
                return await result if inspect.isawaitable(result) else result

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        inner_stream = handler.unary_stream

        async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Malformed):
                await context.abort(*_refuse(method, request))
            result = inner_stream(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            else:  # a coroutine that writes with context.write()
                await result

        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
