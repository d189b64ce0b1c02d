"""Rollout servers' side of the trajectories stream: one idempotent, bounded insert per group.

A put is one round trip: ``MULTI; SET payload:<nonce> <bytes> PX ttl; EVALSHA PUT; EXEC`` (see
:mod:`buffer.scripts`); :meth:`TrajectoryWriter.put_many` sends the SET and EVALSHA of several groups
in that one MULTI, each EVALSHA still deciding for its own group. The duplicate check, the bound check
and the append happen atomically, so a retried insert after a lost reply never creates a second entry (the
retry's payload is deleted), and concurrent producers cannot overshoot the bound together. Nothing is left
behind by a crash: the transaction runs whole or not at all, and a payload that waits for room carries a
TTL. When the stream is full the producer re-runs only the small script with a growing back-off (the
payload stays in Redis) until ``put_timeout_s`` and then raises :class:`BufferFull` (the rollout server
answers RESOURCE_EXHAUSTED) — it never trims entries the learner has not used.

The transaction is written straight onto a pooled connection rather than through ``client.pipeline()``:
redis-py's pipeline machinery (and its ``SCRIPT EXISTS`` check before every scripted pipeline) costs
more than Redis spends storing a 1K-token group.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import redis
from redis.exceptions import NoScriptError, ResponseError

from buffer.codec import encode_group_payload
from buffer.keys import RedisKeys
from buffer.replies import text
from buffer.scripts import Scripts
from tether.config.buffer import BufferConfig
from tether.trajectory import GroupData, InvalidTrajectory

_BACKOFF_START_S = 0.005
_BACKOFF_MAX_S = 0.25
# A payload waiting for room outlives the producer's whole wait by this much, then expires if the
# producer died meanwhile.
_PENDING_PAYLOAD_GRACE_S = 30.0


_SEND_ALONE = 256 * 1024  # a payload this large is sent as its own buffer rather than copied into one
_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"


def _resp(command: tuple) -> list[bytes]:
    """One command in RESP, as pieces to send: the payload is referenced, not copied (:func:`_coalesce`).
    (redis-py's packer costs more Python per put than the rest of the put together, and copies the payload
    once more.)"""
    out = [b"*%d\r\n" % len(command)]
    for arg in command:
        raw = arg if isinstance(arg, (bytes, bytearray)) else str(arg).encode()
        out += (b"$%d\r\n" % len(raw), raw, b"\r\n")
    return out


def _coalesce(pieces: list[bytes]) -> list[bytes]:
    """The buffers to send: runs of small pieces joined into one, each piece of :data:`_SEND_ALONE` bytes
    or more as itself. Joining saves a syscall and a wake-up of Redis per piece, which costs more than
    copying a small payload once more; a large one costs more to copy (a G=8 group of 16K-token
    completions, 1.8 MB: a put_many of 8 such groups took 18 % less time sent this way, 4K-token groups
    3–5 % less, 1K-token ones, 115 KB, the same)."""
    out: list[bytes] = []
    run: list[bytes] = []
    for piece in pieces:
        if len(piece) >= _SEND_ALONE:
            if run:
                out.append(b"".join(run))
                run = []
            out.append(piece)
        else:
            run.append(piece)
    if run:
        out.append(b"".join(run))
    return out


class BufferFull(RuntimeError):
    """The trajectories stream stayed over its bound for the whole put timeout.

    From :meth:`TrajectoryWriter.put_many`, ``decided`` says what became of the batch's other groups:
    batch index → stream id (inserted) or None (already in the buffer); a group not in it was not inserted.
    """

    def __init__(self, message: str, decided: dict[int, str | None] | None = None) -> None:
        super().__init__(message)
        self.decided: dict[int, str | None] = decided or {}


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
        return self.put_many([group], timeout_s=timeout_s)[0]

    def put_many(self, groups: list[GroupData], *, timeout_s: float | None = None) -> list[str | None]:
        """:meth:`put` for several groups in one round trip (groups that finished together); per group its
        stream id or None (a duplicate). Each group stays its own idempotent, atomic insert: a batch is
        never half a group, and a group id repeated within it is inserted once.

        Every group is encoded before Redis is touched, so a malformed one raises
        :class:`InvalidTrajectory` (naming it) with nothing inserted. :class:`BufferFull` once a group
        still has no room after ``timeout_s``: the groups that found room stay inserted (a retry of the
        batch finds them as duplicates), the others leave nothing behind.
        """
        encoded = []
        for group in groups:
            if not group.group_id:
                raise InvalidTrajectory("trajectory group has no group_id (it is the idempotency key of the insert)")
            enc = encode_group_payload(
                group,
                compression=self.cfg.compression,
                compress_min_bytes=self.cfg.compress_min_bytes,
                level=self.cfg.compress_level,
            )
            encoded.append(
                self._prepare(
                    group.group_id,
                    codec=enc.codec,
                    payload=enc.payload,
                    oldest_version=enc.oldest_version,
                    tokens=enc.tokens,
                    lengths=enc.lengths,
                )
            )
        return self._insert(encoded, timeout_s)

    def put_encoded(
        self,
        group_id: str,
        *,
        codec: bytes,
        payload: bytes,
        oldest_version: int,
        tokens: int = 0,
        lengths: str = "",
        timeout_s: float | None = None,
    ) -> str | None:
        """:meth:`put` for a payload already encoded by :func:`buffer.codec.encode_payload`."""
        put = self._prepare(
            group_id, codec=codec, payload=payload, oldest_version=oldest_version, tokens=tokens, lengths=lengths
        )
        return self._insert([put], timeout_s)[0]

    def _prepare(
        self, group_id: str, *, codec: bytes, payload: bytes, oldest_version: int, tokens: int, lengths: str
    ) -> _Put:
        nonce = f"{self._nonce_prefix}-{next(self._count)}"
        keys = [self.keys.trajectories, self.keys.seen(group_id), self.keys.counters, self.keys.payload(nonce)]
        cfg = self.cfg
        args = [cfg.max_trajectory_groups, cfg.max_trajectory_bytes, self._ttl_ms, tokens, group_id, oldest_version,
                codec, nonce, lengths]  # fmt: skip
        return _Put(keys, args, payload)

    def _insert(self, puts: list[_Put], timeout_s: float | None) -> list[str | None]:
        if not puts:
            return []
        timeout = self.cfg.put_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        ttl_ms = int((timeout + _PENDING_PAYLOAD_GRACE_S) * 1000)
        replies = self._put_with_payload(puts, ttl_ms)
        out: list[str | None] = []
        for i, (put, reply) in enumerate(zip(puts, replies, strict=True)):
            try:
                out.append(self._finish(put, reply, deadline=deadline, timeout=timeout, ttl_ms=ttl_ms))
            except BufferFull as full:
                # The later groups that found no room either: their payloads go too (their TTL would free
                # them, but only after the grace period). Those that did fit (a smaller group under the
                # byte bound) stay in, and the error says so: a caller that retried them would be told
                # "duplicate" for a group this very batch inserted.
                decided: dict[int, str | None] = dict(enumerate(out))
                waiting = []
                for j, (p, r) in enumerate(zip(puts[i + 1 :], replies[i + 1 :], strict=True), start=i + 1):
                    status = int(r[0])
                    if status < 0:
                        waiting.append(p.payload_key)
                    else:
                        decided[j] = text(r[1]) if status == 1 else None
                if waiting:
                    self.client.delete(*waiting)
                full.decided = decided
                raise
        return out

    def _finish(self, put: _Put, reply: list, *, deadline: float, timeout: float, ttl_ms: int) -> str | None:
        """Waits out a full stream for one group (the payload stays in Redis); its stream id or None."""
        backoff = _BACKOFF_START_S
        while True:
            status = int(reply[0])
            if status == 1:
                return text(reply[1])
            if status == 0:
                return None
            now = time.monotonic()
            if status == -1 and now >= deadline:
                self.client.delete(put.payload_key)  # no one will use it now; its TTL would free it anyway
                depth, used = int(reply[1]), int(reply[2])
                raise BufferFull(
                    f"trajectory buffer full for {timeout:g}s: {depth} unacknowledged groups "
                    f"(max_trajectory_groups {self.cfg.max_trajectory_groups}), {used} bytes "
                    f"(max_trajectory_bytes {self.cfg.max_trajectory_bytes}); the learner is not keeping up — "
                    "retry later, add learner capacity, or raise buffer.max_trajectory_* / algorithm.max_staleness"
                )
            if status == -2:  # the waiting payload expired (or was evicted): send it again
                reply = self._put_with_payload([put], ttl_ms)[0]
                continue
            time.sleep(min(backoff, max(0.0, deadline - now)))
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
            reply = self._scripts.put(keys=put.keys, args=put.args)  # the payload is still in Redis

    def _put_with_payload(self, puts: list[_Put], ttl_ms: int) -> list[list]:
        """``SET`` each payload and run PUT for it, all in one MULTI/EXEC round trip; PUT's replies."""
        for attempt in range(3):
            try:
                return self._transaction(puts, ttl_ms)
            except NoScriptError:  # Redis restarted or SCRIPT FLUSH: load it, then the retry is safe
                self.client.script_load(self._scripts.put.script)
            except (redis.ConnectionError, redis.TimeoutError):
                if attempt == 2:
                    raise
                # The insert is idempotent by group id, so resending after a lost reply is safe.
                time.sleep(_BACKOFF_START_S * (attempt + 1))
        raise NoScriptError("PUT script could not be loaded")

    def _transaction(self, puts: list[_Put], ttl_ms: int) -> list[list]:
        pieces = [_MULTI]
        for p in puts:
            pieces += _resp(("SET", p.payload_key, p.payload, "PX", ttl_ms))
            pieces += _resp(("EVALSHA", self._scripts.put.sha, len(p.keys), *p.keys, *p.args))
        pieces.append(_EXEC)
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(_coalesce(pieces))
            replies = [conn.read_response() for _ in range(1 + 2 * len(puts))]  # OK, then QUEUED each
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
        if not isinstance(result, list) or len(result) != 2 * len(puts):
            raise ResponseError(f"MULTI/EXEC of a buffer put returned {result!r}")
        for r in result:
            if isinstance(r, ResponseError):
                raise r
        return result[1::2]


@dataclass(slots=True)
class _Put:
    """One group's insert: its PUT keys and arguments, and the payload stored under ``keys[3]``."""

    keys: list[str]
    args: list
    payload: bytes

    @property
    def payload_key(self) -> str:
        return self.keys[3]  # PUT's KEYS[4]: where the payload waits (see _prepare)
