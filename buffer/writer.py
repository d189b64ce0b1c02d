"""Rollout servers' side of the trajectories stream: one idempotent, bounded insert per group.

A put is one round trip: ``MULTI; SET payload:<nonce> <bytes> PX ttl; EVALSHA PUT; EXEC`` (see
:mod:`buffer.scripts`). The duplicate check, the bound check and the append happen atomically, so a
retried insert after a lost reply never creates a second entry (the retry's payload is deleted), and
concurrent producers cannot overshoot the bound together. Nothing is left behind by a crash: the
transaction runs whole or not at all, and a payload that waits for room carries a TTL. When the stream
is full the producer re-runs only the small script with a growing back-off (the payload stays in Redis)
until ``put_timeout_s`` and then raises :class:`BufferFull` (the rollout server answers
RESOURCE_EXHAUSTED) — it never trims entries the learner has not used.

The transaction is written straight onto a pooled connection rather than through ``client.pipeline()``:
redis-py's pipeline machinery (and its ``SCRIPT EXISTS`` check before every scripted pipeline) costs
more than Redis spends storing a 1K-token group.
"""

from __future__ import annotations

import itertools
import os
import time

import redis
from redis.exceptions import NoScriptError, ResponseError

from buffer.codec import encode_group_payload
from buffer.keys import RedisKeys
from buffer.scripts import Scripts
from tether.config.buffer import BufferConfig
from tether.trajectory import GroupData, InvalidTrajectory

_BACKOFF_START_S = 0.005
_BACKOFF_MAX_S = 0.25
# A payload waiting for room outlives the producer's whole wait by this much, then expires if the
# producer died meanwhile.
_PENDING_PAYLOAD_GRACE_S = 30.0


_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"


def _resp(command: tuple) -> list[bytes]:
    """One command in RESP, as pieces to join: the payload is referenced, not copied, until the single join.
    (redis-py's packer costs more Python per put than the rest of the put together, and copies the payload
    once more.)"""
    out = [b"*%d\r\n" % len(command)]
    for arg in command:
        raw = arg if isinstance(arg, (bytes, bytearray)) else str(arg).encode()
        out += (b"$%d\r\n" % len(raw), raw, b"\r\n")
    return out


class BufferFull(RuntimeError):
    """The trajectories stream stayed over its bound for the whole put timeout."""


class TrajectoryWriter:
    def __init__(self, client: redis.Redis, keys: RedisKeys, cfg: BufferConfig) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self._scripts = Scripts(client)
        self._ttl_ms = max(1, int(cfg.dedup_ttl_s * 1000))
        self._nonce_prefix = os.urandom(8).hex()  # payload keys of different writers never collide
        self._count = itertools.count()

    def put(self, group: GroupData, *, timeout_s: float | None = None) -> str | None:
        """Insert ``group``; its stream id, or None when this group id was already inserted.

        Raises :class:`InvalidTrajectory` for a malformed group (before touching Redis) and
        :class:`BufferFull` when there is no room within ``timeout_s`` (default ``put_timeout_s``).
        """
        if not group.group_id:
            raise InvalidTrajectory("trajectory group has no group_id (it is the idempotency key of the insert)")
        enc = encode_group_payload(
            group,
            compression=self.cfg.compression,
            compress_min_bytes=self.cfg.compress_min_bytes,
            level=self.cfg.compress_level,
        )
        return self.put_encoded(
            group.group_id,
            codec=enc.codec,
            payload=enc.payload,
            oldest_version=enc.oldest_version,
            tokens=enc.tokens,
            timeout_s=timeout_s,
        )

    def put_encoded(
        self,
        group_id: str,
        *,
        codec: bytes,
        payload: bytes,
        oldest_version: int,
        tokens: int = 0,
        timeout_s: float | None = None,
    ) -> str | None:
        """:meth:`put` for a payload already encoded by :func:`buffer.codec.encode_payload`."""
        timeout = self.cfg.put_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        nonce = f"{self._nonce_prefix}-{next(self._count)}"
        payload_key = self.keys.payload(nonce)
        keys = [self.keys.trajectories, self.keys.seen(group_id), self.keys.counters, payload_key]
        args = [
            self.cfg.max_trajectory_groups,
            self.cfg.max_trajectory_bytes,
            self._ttl_ms,
            tokens,
            group_id,
            oldest_version,
            codec,
            nonce,
        ]
        payload_ttl_ms = int((timeout + _PENDING_PAYLOAD_GRACE_S) * 1000)
        backoff = _BACKOFF_START_S
        reply = self._put_with_payload(keys, args, payload, payload_ttl_ms)
        while True:
            status = int(reply[0])
            if status == 1:
                return reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            if status == 0:
                return None
            now = time.monotonic()
            if status == -1 and now >= deadline:
                self.client.delete(payload_key)  # no one will use it now; its TTL would free it anyway
                depth, used = int(reply[1]), int(reply[2])
                raise BufferFull(
                    f"trajectory buffer full for {timeout:g}s: {depth} unacknowledged groups "
                    f"(max_trajectory_groups {self.cfg.max_trajectory_groups}), {used} bytes "
                    f"(max_trajectory_bytes {self.cfg.max_trajectory_bytes}); the learner is not keeping up — "
                    "retry later, add learner capacity, or raise buffer.max_trajectory_* / algorithm.max_staleness"
                )
            if status == -2:  # the waiting payload expired (or was evicted): send it again
                reply = self._put_with_payload(keys, args, payload, payload_ttl_ms)
                continue
            time.sleep(min(backoff, max(0.0, deadline - now)))
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
            reply = self._scripts.put(keys=keys, args=args)  # the payload is still in Redis

    def _put_with_payload(self, keys: list[str], args: list, payload: bytes, ttl_ms: int) -> list:
        """``SET`` the payload and run PUT in one MULTI/EXEC round trip; PUT's reply."""
        for attempt in range(3):
            try:
                return self._transaction(keys, args, payload, ttl_ms)
            except NoScriptError:  # Redis restarted or SCRIPT FLUSH: load it, then the retry is safe
                self.client.script_load(self._scripts.put.script)
            except (redis.ConnectionError, redis.TimeoutError):
                if attempt == 2:
                    raise
                # The insert is idempotent by group id, so resending after a lost reply is safe.
                time.sleep(_BACKOFF_START_S * (attempt + 1))
        raise NoScriptError("PUT script could not be loaded")

    def _transaction(self, keys: list[str], args: list, payload: bytes, ttl_ms: int) -> list:
        blob = b"".join(
            [
                _MULTI,
                *_resp(("SET", keys[3], payload, "PX", ttl_ms)),
                *_resp(("EVALSHA", self._scripts.put.sha, len(keys), *keys, *args)),
                _EXEC,
            ]
        )
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            # One send (one syscall, one wake-up of Redis) instead of one per chunk: copying the payload
            # once more costs less than the extra round of scheduling on a busy host.
            conn.send_packed_command([blob])
            replies = [conn.read_response() for _ in range(3)]  # OK, QUEUED, QUEUED
            result = conn.read_response()
        except BaseException:
            # Whatever was half read is unusable: drop the connection rather than hand it back
            # to the pool mid-reply.
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        for r in replies:
            if isinstance(r, ResponseError):
                raise r
        if not isinstance(result, list):
            raise ResponseError(f"MULTI/EXEC of a buffer put returned {result!r}")
        for r in result:
            if isinstance(r, ResponseError):
                raise r
        return result[1]
