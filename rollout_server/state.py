"""What every part of one rollout server shares: config, engine, metrics, the buffer, admission.

Admission is counted here (not with grpc's ``maximum_concurrent_rpcs``) so the refusal carries a
message and draining can answer UNAVAILABLE while health flips to NOT_SERVING. ``rpc`` wraps one
call: it maps :class:`BadRequest` to its status with the message, times the call, and counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from rollout_server.engines import Engine
from rollout_server.engines.base import EngineRejected
from rollout_server.metrics import ServerMetrics
from rollout_server.shares import ShareGate
from rollout_server.sink import BufferSink
from rollout_server.validation import BadRequest
from tether.config import TetherConfig
from tether.logs import get_logger

log = get_logger(__name__)


@dataclass
class ServerState:
    cfg: TetherConfig
    engine: Engine
    server_id: str
    metrics: ServerMetrics
    sink: BufferSink | None = None
    address: str = ""
    openai_address: str = ""
    """The OpenAI-compatible door's base URL (``http://host:port/v1``); "" when it is off."""
    draining: bool = False
    inflight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    share_gate: ShareGate | None = None
    """On a fleet serving several runs: the process's fair-share gate each generation of the prompt worker
    passes (``rollout.share``); None for a server of one run."""

    def __post_init__(self) -> None:
        self.idle.set()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[None]:
        """One unit of admitted work (an RPC or a prompt the worker took)."""
        if self.draining:
            raise BadRequest("server is draining (shutting down); retry on another server", grpc.StatusCode.UNAVAILABLE)
        limit = self.cfg.rollout.max_concurrent_requests
        if self.inflight >= limit:
            raise BadRequest(
                f"overloaded: {self.inflight} requests in flight (rollout.max_concurrent_requests={limit}); retry",
                grpc.StatusCode.RESOURCE_EXHAUSTED,
            )
        self.inflight += 1
        self.idle.clear()
        self.metrics.running.set(self.engine.running_requests)
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()
            self.metrics.running.set(self.engine.running_requests)
            self.metrics.queued.set(self.engine.queued_requests)

    @contextlib.asynccontextmanager
    async def rpc(self, method: str, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        start = time.perf_counter()
        code = "OK"
        try:
            yield
        except BadRequest as e:
            code = e.code.name
            await context.abort(e.code, str(e))
        except EngineRejected as e:
            code = "INVALID_ARGUMENT"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"sampling: the engine refused it: {e}")
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        except Exception as e:
            if isinstance(e, grpc.aio.AbortError):
                code = "ABORTED_BY_HANDLER"
                raise
            code = "INTERNAL"
            log.exception("rpc_failed", method=method, error=str(e))
            await context.abort(grpc.StatusCode.INTERNAL, f"{method}: {type(e).__name__}: {e}")
        finally:
            self.metrics.requests.labels(method, code).inc()
            self.metrics.latency.labels(method).observe(time.perf_counter() - start)

    def vocab_size(self) -> int:
        model = getattr(self.engine, "model", None)
        config = getattr(model, "config", None)
        size = getattr(config, "vocab_size", None)
        return int(size) if size else len(self.engine.tokenizer)

    def status_extra(self) -> dict[str, Any]:
        return {"running": self.engine.running_requests, "queued": self.engine.queued_requests}
