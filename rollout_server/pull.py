"""The ``store`` weight transport on a rollout server: its :class:`~weight_sync.puller.Puller`, wired to
this server's engine and to the run's Redis (the announced version, the live servers and what each holds).

Started by ``rollout_server.main`` when ``weight_sync.transport.type`` is ``store``: one pull before the
port opens (a new server serves the current version from its first request, as a catch-up from a snapshot
did), then a task that pulls each version the learner announces. Weight sync's Control RPCs stay for a
learner that pushes.
"""

from __future__ import annotations

from collections.abc import Callable

from rollout_server.sink import BufferSink
from rollout_server.state import ServerState
from tether.logs import get_logger

log = get_logger(__name__)


class SinkPeerDirectory:
    """:class:`weight_sync.puller.PeerDirectory` over a server's Redis (``rollout_server.sink.BufferSink``)."""

    def __init__(self, sink: BufferSink, on_record: Callable[[int], None] | None = None) -> None:
        self.sink, self.on_record = sink, on_record

    async def announced(self) -> dict | None:
        return await self.sink.weights_announced()

    async def members(self) -> list:
        from weight_sync.puller import Member

        held = await self.sink.weights_held()
        return [Member(sid, h.version, h.peer) for sid, h in held.items()]

    async def record(self, version: int, peer: str) -> None:
        await self.sink.record_weights(version, peer)
        if self.on_record is not None and version >= 0:
            self.on_record(version)


def peer_host(state: ServerState) -> tuple[str, str | None]:
    """(bind, advertise) for this server's chunk service: ``transport.peer_host``, else the host it serves
    gRPC on; a server bound to every interface advertises the host its registry entry names."""
    host = state.cfg.weight_sync.transport.peer_host or state.cfg.rollout.host
    if host in ("", "0.0.0.0", "[::]"):
        return "0.0.0.0", state.address.rsplit(":", 1)[0]
    return host, None


async def start_puller(state: ServerState):  # type: ignore[no-untyped-def]
    """The server's puller, after a first pull of the announced version (a failure there is logged and the
    server serves what it has; the puller's task tries again)."""
    from weight_sync.puller import Puller

    engine, fleet = state.engine, SinkPeerDirectory(state.sink, on_record=state.metrics.policy_version.set)
    bind, advertise = peer_host(state)
    puller = Puller(engine, state.cfg, delivery=engine.weight_delivery(state.cfg), fleet=fleet,
                    server_id=state.server_id, peer_host=bind, advertise_host=advertise)  # fmt: skip
    state.metrics.watch_weight_pulls(lambda: dict(puller.stats))
    try:
        await puller.join()
        announced = await fleet.announced()
        if announced is not None:
            await puller.pull(announced)
    except Exception as e:
        puller.stats["pull_failures"] += 1
        log.warning("weight_join_failed", error=str(e))
    return puller
