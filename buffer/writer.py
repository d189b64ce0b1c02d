"""Rollout servers' side of the trajectories stream: one idempotent, bounded insert per group.

A put is a single EVALSHA (see :mod:`buffer.scripts`): the duplicate check, the bound check and the
XADD happen atomically in one round trip, so a retried insert after a lost reply never creates a
second entry, and concurrent producers cannot overshoot the bound together. When the stream is full
the producer polls with a growing back-off until ``put_timeout_s`` and then raises :class:`BufferFull`
(the rollout server answers RESOURCE_EXHAUSTED) — it never trims entries the learner has not used.
"""

from __future__ import annotations

import time

import redis

from buffer.codec import encode_payload
from buffer.keys import RedisKeys
from buffer.scripts import Scripts
from tether.config.buffer import BufferConfig
from tether.trajectory import GroupData, InvalidTrajectory

_BACKOFF_START_S = 0.005
_BACKOFF_MAX_S = 0.25


class BufferFull(RuntimeError):
    """The trajectories stream stayed over its bound for the whole put timeout."""


class TrajectoryWriter:
    def __init__(self, client: redis.Redis, keys: RedisKeys, cfg: BufferConfig) -> None:
        self.client = client
        self.keys = keys
        self.cfg = cfg
        self._scripts = Scripts(client)
        self._ttl_ms = max(1, int(cfg.dedup_ttl_s * 1000))

    def put(self, group: GroupData, *, timeout_s: float | None = None) -> str | None:
        """Insert ``group``; its stream id, or None when this group id was already inserted.

        Raises :class:`InvalidTrajectory` for a malformed group (before touching Redis) and
        :class:`BufferFull` when there is no room within ``timeout_s`` (default ``put_timeout_s``).
        """
        if not group.group_id:
            raise InvalidTrajectory("trajectory group has no group_id (it is the idempotency key of the insert)")
        codec, payload = encode_payload(
            group,
            compression=self.cfg.compression,
            compress_min_bytes=self.cfg.compress_min_bytes,
            level=self.cfg.compress_level,
        )
        return self.put_encoded(
            group.group_id,
            codec=codec,
            payload=payload,
            oldest_version=group.oldest_version,
            tokens=sum(t.num_completion_tokens for t in group.trajectories),
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
        keys = [self.keys.trajectories, self.keys.seen(group_id), self.keys.counters]
        args = [
            self.cfg.max_trajectory_groups,
            self.cfg.max_trajectory_bytes,
            self._ttl_ms,
            tokens,
            group_id,
            oldest_version,
            codec,
            payload,
        ]
        backoff = _BACKOFF_START_S
        while True:
            reply = self._scripts.put(keys=keys, args=args)
            status = int(reply[0])
            if status == 1:
                return reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
            if status == 0:
                return None
            now = time.monotonic()
            if now >= deadline:
                depth, used = int(reply[1]), int(reply[2])
                raise BufferFull(
                    f"trajectory buffer full for {timeout:g}s: {depth} unacknowledged groups "
                    f"(max_trajectory_groups {self.cfg.max_trajectory_groups}), {used} bytes "
                    f"(max_trajectory_bytes {self.cfg.max_trajectory_bytes}); the learner is not keeping up — "
                    "retry later, add learner capacity, or raise buffer.max_trajectory_* / algorithm.max_staleness"
                )
            time.sleep(min(backoff, deadline - now))
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
