"""The bearer-token check of every tether gRPC server: rollout servers, the weight store, reward services.

One rule: a call must carry ``authorization: Bearer <token>`` (compared in constant time, so a token cannot
be guessed by timing), except health checks and reflection — probes cannot send metadata, and reflection
shows only the public protos. A refused call ends UNAUTHENTICATED, naming what was wrong and the method,
before the server does any work or decodes its request. :class:`BearerAuth` serves ``grpc.aio`` servers,
:class:`SyncBearerAuth` thread-pool ones (the weight store's chunk service).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def refusal(details: grpc.HandlerCallDetails, expected: bytes) -> str | None:
    """Why the call may not run (None: it may)."""
    if details.method.startswith(OPEN_PREFIXES):
        return None
    sent = dict(details.invocation_metadata or ()).get("authorization", "")
    if hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, expected):
        return None
    what = "missing 'authorization: Bearer <token>' metadata" if not sent else "wrong bearer token"
    return f"{what} for {details.method}"


def _denied(handler: grpc.RpcMethodHandler, message: str, *, aio: bool) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind that only aborts with UNAUTHENTICATED."""
    if aio:

        async def unary(_request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def streaming(_request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator
    else:

        def unary(_request: Any, context: grpc.ServicerContext) -> Any:  # type: ignore[misc]
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def streaming(_request: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # type: ignore[misc]
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this a generator

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.stream_stream:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class BearerAuth(grpc.aio.ServerInterceptor):
    """Requires the bearer token on every call of a ``grpc.aio`` server except health and reflection."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:  # fmt: skip
        handler = await continuation(details)
        message = None if handler is None else refusal(details, self._expected)
        return handler if message is None else _denied(handler, message, aio=True)


class SyncBearerAuth(grpc.ServerInterceptor):
    """:class:`BearerAuth` for a thread-pool (synchronous) server."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:  # fmt: skip
        handler = continuation(details)
        message = None if handler is None else refusal(details, self._expected)
        return handler if message is None else _denied(handler, message, aio=False)
