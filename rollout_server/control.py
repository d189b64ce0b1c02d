"""The learner-facing ``tether.v1.Control`` servicer: pause / resume and the weight-update stages.

Pause and resume act on the engine directly; a pause not followed by a resume within
``rollout.pause_timeout_s`` ends by itself (its client may have died between the two calls). The three
weight-update stages belong to
``weight_sync.receiver.WeightReceiver`` (docs/ARCHITECTURE.md), wired here to the engine: the engine is
what it loads into (its ``load_weights``), by the delivery the engine picks (``weight_delivery``: in this
process, or inside vLLM's workers). It is imported on the first update, so a server that is never
updated does not load the weight-transfer stack; only the light contract (``weight_sync.loading``: the
in-flight policy's mapping, which Pause needs) is imported here.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from rollout_server.state import ServerState
from rollout_server.validation import BadRequest
from tether.logs import get_logger
from tether.v1 import control_pb2, control_pb2_grpc
from weight_sync.loading import inflight_policy

log = get_logger(__name__)


def load_receiver(state: ServerState) -> Any:
    """A ``WeightReceiver`` for this server's engine, or BadRequest(UNIMPLEMENTED) saying why not."""
    from weight_sync.receiver import WeightReceiver

    try:
        return WeightReceiver(state.engine, state.cfg, delivery=state.engine.weight_delivery(state.cfg))
    except NotImplementedError as e:  # an engine that refuses weight updates outright
        raise BadRequest(f"weight updates are unavailable on this server: {e}", grpc.StatusCode.UNIMPLEMENTED) from None


class ControlServicer(control_pb2_grpc.ControlServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self._receiver: Any = None
        self._pause_expiry: asyncio.Task | None = None

    def receiver(self) -> Any:
        if self._receiver is None:
            self._receiver = load_receiver(self.state)
        return self._receiver

    async def _stage(self, stage: str, request: Any) -> Any:
        """One receiver stage, its refusals mapped to status codes the learner can act on.

        The receiver says "bad plan" with ValueError and "not possible now" (unknown update, failed
        transfer) with WeightSyncError; left to ``state.rpc`` both would read as INTERNAL, a server bug,
        which fuzzing showed. The test receiver (``tests/weight_receiver.py``) answers with the same codes.
        """
        receiver = self.receiver()
        from weight_sync.receiver import WeightSyncError  # importable: receiver() just loaded it

        try:
            return await getattr(receiver, stage)(request)
        except ValueError as e:
            raise BadRequest(f"{stage}: {e}") from None
        except WeightSyncError as e:
            raise BadRequest(f"{stage}: {e}", grpc.StatusCode.FAILED_PRECONDITION) from None

    async def Pause(self, request: control_pb2.PauseRequest, context: grpc.aio.ServicerContext):
        async with self.state.rpc("Pause", context):
            policy = inflight_policy(request.inflight, self.state.cfg.weight_sync.inflight)
            await self.state.engine.pause(policy)
            self._expire_pause_after(self.state.cfg.rollout.pause_timeout_s)
            log.info("paused", inflight=policy)
            return control_pb2.PauseResponse(
                policy_version=self.state.engine.policy_version, inflight_requests=self.state.engine.running_requests
            )

    async def Resume(self, request: control_pb2.ResumeRequest, context: grpc.aio.ServicerContext):
        async with self.state.rpc("Resume", context):
            self._expire_pause_after(None)
            await self.state.engine.resume()
            log.info("resumed", policy_version=self.state.engine.policy_version)
            return control_pb2.ResumeResponse(policy_version=self.state.engine.policy_version)

    def _expire_pause_after(self, timeout_s: float | None) -> None:
        """(Re)start the paused server's clock, or stop it (``None``, 0: no clock)."""
        if self._pause_expiry is not None:
            self._pause_expiry.cancel()
            self._pause_expiry = None
        if timeout_s:
            self._pause_expiry = asyncio.get_running_loop().create_task(self._expire_pause(timeout_s))

    async def _expire_pause(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        self._pause_expiry = None
        if self._receiver is not None and self._receiver.updating:
            return  # a weight update holds the engine now, and resumes it when it ends
        engine = self.state.engine
        if engine.paused:
            await engine.resume()
            self.state.metrics.pauses_expired.inc()
            log.warning("pause_expired", after_s=timeout_s, policy_version=engine.policy_version,
                        hint="no Resume came within rollout.pause_timeout_s; the server generates again")  # fmt: skip

    async def PrepareWeightUpdate(self, request: control_pb2.WeightUpdatePlan, context: grpc.aio.ServicerContext):
        async with self.state.rpc("PrepareWeightUpdate", context):
            return await self._stage("prepare", request)

    async def CommitWeightUpdate(
        self, request: control_pb2.CommitWeightUpdateRequest, context: grpc.aio.ServicerContext
    ):
        async with self.state.rpc("CommitWeightUpdate", context):
            response = await self._stage("commit", request)
            self.state.metrics.policy_version.set(self.state.engine.policy_version)
            return response

    async def AbortWeightUpdate(self, request: control_pb2.AbortWeightUpdateRequest, context: grpc.aio.ServicerContext):
        async with self.state.rpc("AbortWeightUpdate", context):
            return await self._stage("abort", request)
