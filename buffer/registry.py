"""Who is alive, and which policy version is current: the two small facts every process asks Redis.

Liveness is one key per rollout server holding its JSON ``ServerInfo`` with a TTL: Redis expires a
server that stops heartbeating, so no clock on any host is trusted, and the heartbeat's age is read
from the key's remaining TTL (``ttl_s - PTTL``). A set indexes the ids so :meth:`ServerRegistry.live`
never SCANs the keyspace; ids whose key has expired are pruned from it as they are found.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import redis

from buffer.keys import RedisKeys
from buffer.replies import text


@dataclass
class ServerInfo:
    server_id: str
    address: str = ""
    engine: str = ""
    policy_version: int = 0
    extra: dict[str, str | int | float] = field(default_factory=dict)
    heartbeat_age_s: float = 0.0
    """Filled in by :meth:`ServerRegistry.live`: seconds since the server's last heartbeat."""


class ServerRegistry:
    def __init__(self, client: redis.Redis, keys: RedisKeys) -> None:
        self.client = client
        self.keys = keys

    def heartbeat(self, info: ServerInfo, *, ttl_s: float = 6.0) -> None:
        """Announce ``info`` as live for ``ttl_s`` seconds; call well within the TTL (e.g. every ttl/3)."""
        body = asdict(info)
        body.pop("heartbeat_age_s")
        body["ttl_s"] = ttl_s
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self.keys.server(info.server_id), json.dumps(body), px=max(1, int(ttl_s * 1000)))
        pipe.sadd(self.keys.servers, info.server_id)
        pipe.execute()

    def live(self) -> list[ServerInfo]:
        """Servers whose heartbeat has not expired, sorted by id."""
        ids = sorted(text(i) for i in self.client.smembers(self.keys.servers))
        if not ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for sid in ids:
            pipe.get(self.keys.server(sid))
            pipe.pttl(self.keys.server(sid))
        replies = pipe.execute()
        out, gone = [], []
        for sid, raw, pttl in zip(ids, replies[::2], replies[1::2], strict=True):
            info = _parse(sid, raw, pttl)
            if info is None:
                gone.append(sid)
            else:
                out.append(info)
        if gone:
            # A server may have heartbeated again between the GET and now: only prune ids whose key is
            # still absent, atomically per id.
            for sid in gone:
                self._prune(sid)
        return out

    def _prune(self, sid: str) -> None:
        def txn(pipe: redis.client.Pipeline) -> None:
            missing = not pipe.exists(self.keys.server(sid))
            pipe.multi()
            if missing:
                pipe.srem(self.keys.servers, sid)

        self.client.transaction(txn, self.keys.server(sid))

    def remove(self, server_id: str) -> None:
        """Deregister at a clean shutdown (weight sync stops waiting for this server at once)."""
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.keys.server(server_id))
        pipe.srem(self.keys.servers, server_id)
        pipe.execute()


def _parse(sid: str, raw: bytes | str | None, pttl: int) -> ServerInfo | None:
    if raw is None:
        return None
    try:
        body = json.loads(raw)
        ttl_s = float(body.pop("ttl_s", 0.0))
        info = ServerInfo(
            server_id=str(body.get("server_id", sid)),
            address=str(body.get("address", "")),
            engine=str(body.get("engine", "")),
            policy_version=int(body.get("policy_version", 0)),
            extra=dict(body.get("extra") or {}),
        )
    except (ValueError, TypeError, AttributeError):
        return None  # not written by heartbeat(): treat as not live rather than fail every reader
    info.heartbeat_age_s = max(0.0, ttl_s - pttl / 1000) if pttl >= 0 else 0.0
    return info


def publish_version(client: redis.Redis, keys: RedisKeys, version: int) -> None:
    """Make ``version`` the current policy version (the learner calls this after each weight publication)."""
    if version < 0:
        raise ValueError(f"policy version must be >= 0, got {version}")
    client.set(keys.version, int(version))


def read_version(client: redis.Redis, keys: RedisKeys) -> int:
    """The current policy version; 0 before the first publication."""
    raw = client.get(keys.version)
    return int(raw) if raw is not None else 0
