"""Rollout fleets serving several runs (``tether rollout --runs``), as Redis knows them: what ``tether status
--fleets`` shows.

A fleet writes its state every heartbeat under ``tether:fleet:{fleet_id}`` with a TTL (three missed beats and
it is gone) and indexes its id in ``tether:fleets``; the state is JSON: the fleet's host, its gate's capacity
and, per run it serves, the run's share, the tokens and groups its generations spent, what waits and runs
now, and the slot's server id in that run's registry. Like the server registry, liveness is the key's TTL,
so no host clock is trusted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis

from buffer.replies import text

FLEETS = "tether:fleets"
"""Set of the fleet ids that have heartbeated (an index; liveness is each fleet's own key)."""


def fleet_key(fleet_id: str) -> str:
    return f"tether:fleet:{fleet_id}"


@dataclass
class FleetState:
    fleet_id: str
    host: str = ""
    capacity: int = 0
    runs: dict[str, dict] = field(default_factory=dict)
    """Run id -> ``share``, ``tokens``, ``groups``, ``waiting``, ``inflight``, ``server_id``."""


def publish_fleet(client: redis.Redis, state: FleetState, *, ttl_s: float) -> None:
    body = {"fleet_id": state.fleet_id, "host": state.host, "capacity": state.capacity, "runs": state.runs}
    pipe = client.pipeline(transaction=True)
    pipe.set(fleet_key(state.fleet_id), json.dumps(body), px=max(1, int(ttl_s * 1000)))
    pipe.sadd(FLEETS, state.fleet_id)
    pipe.execute()


def forget_fleet(client: redis.Redis, fleet_id: str) -> None:
    """A fleet that stopped cleanly: gone at once rather than after its TTL."""
    pipe = client.pipeline(transaction=True)
    pipe.delete(fleet_key(fleet_id))
    pipe.srem(FLEETS, fleet_id)
    pipe.execute()


def live_fleets(client: redis.Redis) -> list[FleetState]:
    """The fleets whose heartbeat has not expired, sorted by id; an expired id leaves the index."""
    ids = sorted(text(i) for i in client.smembers(FLEETS))
    out = []
    for fleet_id, raw in zip(ids, client.mget([fleet_key(i) for i in ids]) if ids else [], strict=True):
        if raw is None:
            client.srem(FLEETS, fleet_id)
            continue
        try:
            body = json.loads(raw)
            out.append(FleetState(fleet_id, str(body.get("host", "")), int(body.get("capacity", 0)),
                                  dict(body.get("runs") or {})))  # fmt: skip
        except (ValueError, TypeError, AttributeError):
            continue  # not written by publish_fleet: not shown rather than fail the view
    return out
