"""Write a ``tether.v1.Reward`` gRPC service in a few lines.

    from tether.reward_service import RewardService, serve

    class MyReward(RewardService):
        def score(self, req):                       # req: tether.v1.reward_pb2.ScoreRequest
            return float(req.completion.strip() == req.reward_context["answer"])

    serve(MyReward(), port=50070, token=os.environ.get("TETHER_AUTH_TOKEN"))

``score`` returns a reward, or ``(reward, {"component": value, ...})``. It may be a plain function
(run in a worker thread, so a slow scorer never blocks health checks) or ``async def``. Raising
``ValueError``, ``KeyError`` or ``TypeError`` means the request is bad: the caller gets
INVALID_ARGUMENT with the message and the service keeps serving; any other exception is INTERNAL.
``ScoreBatch`` loops over ``score`` unless ``score_batch`` is overridden (e.g. to batch a reward model).

``serve`` adds the standard health service and reflection, checks ``authorization: Bearer <token>``
on Reward calls when a token is set (health stays open: probes cannot send metadata), and on SIGTERM
or SIGINT reports NOT_SERVING, then finishes in-flight calls within the grace period and stops.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import signal
from collections.abc import Awaitable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tether.grpc_auth import BearerAuth
from tether.grpc_parse import ParseGuard
from tether.v1 import reward_pb2, reward_pb2_grpc

ScoreResult = float | tuple[float, dict[str, float]]
# Caller mistakes: the service answers INVALID_ARGUMENT and carries on.
BAD_INPUT = (ValueError, KeyError, TypeError)


class RewardService(reward_pb2_grpc.RewardServicer):
    """Subclass and implement :meth:`score`; the gRPC plumbing is done here."""

    def score(self, req: reward_pb2.ScoreRequest) -> ScoreResult | Awaitable[ScoreResult]:
        raise NotImplementedError("implement score(req) -> float | (float, dict[str, float])")

    async def score_batch(self, reqs: Sequence[reward_pb2.ScoreRequest]) -> list[ScoreResult]:
        """Scores in request order; override to score a batch at once."""
        return [await self._call_score(r) for r in reqs]

    async def _call_score(self, req: reward_pb2.ScoreRequest) -> ScoreResult:
        if inspect.iscoroutinefunction(self.score):
            return await self.score(req)
        return await asyncio.to_thread(self.score, req)

    async def Score(self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext) -> Any:
        result = await _guard(context, self._call_score(request))
        return await _guard(context, _to_response(result), internal=True)

    async def ScoreBatch(self, request: reward_pb2.ScoreBatchRequest, context: grpc.aio.ServicerContext) -> Any:
        results = await _guard(context, self.score_batch(list(request.requests)))
        if len(results) != len(request.requests):
            await context.abort(
                grpc.StatusCode.INTERNAL, f"score_batch returned {len(results)} results for {len(request.requests)}"
            )
        responses = [await _guard(context, _to_response(r), internal=True) for r in results]
        return reward_pb2.ScoreBatchResponse(responses=responses)


async def _to_response(result: ScoreResult) -> reward_pb2.ScoreResponse:
    """Check what ``score`` returned; a bad value is the service's bug, so it maps to INTERNAL."""
    components: dict[str, float] = {}
    if isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[1], dict):
            raise RuntimeError("score must return a float or (float, dict[str, float])")
        result, components = result
    reward = float(result)
    if not math.isfinite(reward):
        raise RuntimeError(f"score returned a non-finite reward ({reward})")
    return reward_pb2.ScoreResponse(reward=reward, components={str(k): float(v) for k, v in components.items()})


async def _guard(context: grpc.aio.ServicerContext, work: Awaitable[Any], *, internal: bool = False) -> Any:
    try:
        return await work
    except BAD_INPUT as e:
        code = grpc.StatusCode.INTERNAL if internal else grpc.StatusCode.INVALID_ARGUMENT
        await context.abort(code, _message(e))
    except Exception as e:  # the scorer's own bug: say so, and keep serving
        await context.abort(grpc.StatusCode.INTERNAL, _message(e))


def _message(e: BaseException) -> str:
    text = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


async def start_server(
    service: RewardService,
    *,
    port: int,
    host: str = "0.0.0.0",
    token: str | None = None,
    max_message_bytes: int = 64 * 1024 * 1024,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """Start the server (health SERVING once bound); returns ``(server, health, bound_port)``."""
    # ParseGuard: a body that is not protobuf is the caller's error (INVALID_ARGUMENT), not UNKNOWN.
    interceptors = [*([BearerAuth(token)] if token else []), ParseGuard()]
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    reward_pb2_grpc.add_RewardServicer_to_server(service, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    name = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name
    reflection.enable_server_reflection([name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"reward service: cannot bind {host}:{port} (port in use?)")
    await server.start()
    for svc in ("", name):
        await health_servicer.set(svc, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, bound


async def serve_async(
    service: RewardService, *, port: int, host: str = "0.0.0.0", token: str | None = None, grace_s: float = 10.0
) -> None:
    """Serve until SIGTERM/SIGINT, then drain: NOT_SERVING first so balancers stop sending, then stop."""
    server, health_servicer, bound = await start_server(service, port=port, host=host, token=token)
    print(f"reward service listening on {host}:{bound} (auth {'on' if token else 'off'})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    stopper.cancel()
    waiter.cancel()


def serve(
    service: RewardService, *, port: int, host: str = "0.0.0.0", token: str | None = None, grace_s: float = 10.0
) -> None:
    """Blocking :func:`serve_async`; an empty token turns authentication off."""
    asyncio.run(serve_async(service, port=port, host=host, token=token or None, grace_s=grace_s))
