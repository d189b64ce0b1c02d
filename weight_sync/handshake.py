"""The learner's side of the update handshake: Control RPCs to many servers at once, each with a deadline.

The learner is synchronous code, so this uses the blocking gRPC API with futures: every server's call of
one stage is in flight at the same time and the stage costs the slowest server, bounded by the stage's
deadline. A server that errs or misses the deadline is simply absent from the result — the caller drops
it from this update; nothing here ever waits longer than the deadline it was given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import grpc

from tether.logs import get_logger
from tether.v1 import control_pb2, control_pb2_grpc

log = get_logger(__name__)


class ControlClients:
    """One channel per server address, kept across updates (a channel reconnects by itself)."""

    def __init__(self, *, token: str | None = None) -> None:
        self._stubs: dict[str, control_pb2_grpc.ControlStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None

    def stub(self, address: str) -> control_pb2_grpc.ControlStub:
        if address not in self._stubs:
            channel = grpc.insecure_channel(
                address,
                options=[("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)],
            )
            self._channels[address] = channel
            self._stubs[address] = control_pb2_grpc.ControlStub(channel)
        return self._stubs[address]

    def forget(self, keep: Sequence[str]) -> None:
        """Close channels of servers that left the fleet."""
        for address in list(self._channels):
            if address not in keep:
                self._channels.pop(address).close()
                self._stubs.pop(address, None)

    def call_all(
        self,
        method: str,
        requests: dict[str, object],
        *,
        timeout_s: float,
        stage: str,
    ) -> tuple[dict[str, object], dict[str, str]]:
        """Call ``method`` on every address at once; returns (responses, errors) keyed by address."""
        return self.start_all(method, requests, timeout_s=timeout_s, stage=stage).result()

    def start_all(self, method: str, requests: dict[str, object], *, timeout_s: float, stage: str) -> PendingCalls:
        """Start ``method`` on every address and return at once; :meth:`PendingCalls.result` collects them."""
        futures = {}
        errors: dict[str, str] = {}
        for address, request in requests.items():
            rpc: Callable = getattr(self.stub(address), method)
            try:
                futures[address] = rpc.future(request, timeout=timeout_s, metadata=self._metadata)
            except Exception as exc:  # e.g. a malformed address
                errors[address] = str(exc)
        return PendingCalls(futures, errors, stage)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        self._stubs.clear()


class PendingCalls:
    """Calls started on several servers; :meth:`result` waits for them (each bounded by its deadline)."""

    def __init__(self, futures: dict, errors: dict[str, str], stage: str) -> None:
        self.futures, self.errors, self.stage = futures, errors, stage

    def result(self) -> tuple[dict[str, object], dict[str, str]]:
        """(responses, errors) keyed by address; every error is logged."""
        futures, errors, stage = self.futures, self.errors, self.stage
        responses: dict[str, object] = {}
        for address, future in futures.items():
            try:
                responses[address] = future.result()
            except grpc.RpcError as exc:
                errors[address] = f"{exc.code().name}: {exc.details()}"
        for address, error in errors.items():
            log.warning("weight_sync_receiver_dropped", stage=stage, server=address, error=error)
        return responses, errors


def abort_all(
    clients: ControlClients, servers: Sequence[str], *, update_id: str, reason: str, timeout_s: float
) -> None:
    """Best effort: tell servers to resume on their current weights (a dead one just does not answer)."""
    if servers:
        request = control_pb2.AbortWeightUpdateRequest(update_id=update_id, reason=reason)
        clients.call_all("AbortWeightUpdate", dict.fromkeys(servers, request), timeout_s=timeout_s, stage="abort")
