"""The rollout server's side of the Redis buffer: prompts in, groups out, heartbeats, dead letters.

One small adapter over ``buffer``'s public API (docs/ARCHITECTURE.md) so the rest of the server never
touches Redis directly. redis-py is synchronous, so every call runs in a worker thread of the sink's own
pool and the gRPC event loop never blocks on a slow or backpressured Redis. The pool is sized for every
prompt worker blocking on a read at once plus the heartbeat and writes, and kept apart from asyncio's
default pool so idle blocking reads can never starve the engine's threads. A server started without ``run.run_id`` or
a reachable ``buffer.redis_url`` has no sink: it serves Generate only.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import urlsplit

from tether import spans
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.trajectory import GroupData
from tether.v1 import trajectory_pb2

log = get_logger(__name__)
T = TypeVar("T")


class BufferSink:
    def __init__(self, cfg: TetherConfig, server_id: str) -> None:
        from buffer import PromptQueue, RedisKeys, ServerRegistry, TrajectoryWriter
        from buffer.evaluation import ValidationQueue
        from tether.redis_server import connect_redis
        from tether.resources import prompt_workers

        assert cfg.run.run_id is not None
        self.cfg = cfg
        self.server_id = server_id
        self.client = connect_redis(cfg.buffer.redis_url)
        self._redis_at = urlsplit(cfg.buffer.redis_url).netloc.rpartition("@")[2]  # host:port, never a password
        self.keys = RedisKeys(cfg.run.run_id)
        self.prompts = PromptQueue(self.client, self.keys, claim_idle_ms=cfg.buffer.claim_idle_ms)
        self.writer = TrajectoryWriter(self.client, self.keys, cfg.buffer)
        self.registry = ServerRegistry(self.client, self.keys)
        self.validation = ValidationQueue(self.client, self.keys, claim_idle_ms=cfg.buffer.claim_idle_ms)
        self._pool = ThreadPoolExecutor(max_workers=prompt_workers(cfg) + 4, thread_name_prefix="redis")
        # The heartbeat has a thread of its own: a liveness mark must never queue behind the data path's
        # calls (blocking prompt reads, inserts waiting for room), or the learner stops counting the server.
        self._beat = ThreadPoolExecutor(max_workers=1, thread_name_prefix="heartbeat")
        self._to_put: list[tuple[GroupData, asyncio.Future[bool]]] = []
        self._putter: asyncio.Task | None = None

    async def _call(self, fn: Callable[..., T], *args: Any, pool: ThreadPoolExecutor | None = None, **kwargs: Any) -> T:
        # A span per Redis call: a Redis that stops answering is what the watchdog then names (tether.spans).
        with spans.span("redis", address=self._redis_at, op=getattr(fn, "__name__", "call")):
            call = functools.partial(fn, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(pool or self._pool, call)

    async def read_prompts(self, *, count: int = 1, block_ms: int = 1000) -> list[tuple[str, trajectory_pb2.Prompt]]:
        import redis

        try:
            return await self._call(self.prompts.read, self.server_id, count=count, block_ms=block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            # The stream or its consumer group was deleted (a reset run, a flushed Redis): recreate both.
            from buffer import PromptQueue

            self.prompts = PromptQueue(self.client, self.keys, claim_idle_ms=self.cfg.buffer.claim_idle_ms)
            return []

    async def read_val_prompts(self, *, count: int = 1) -> list:
        """Evaluation prompts waiting now (never blocks): the worker asks before each training prompt."""
        import redis

        from buffer.evaluation import ValidationQueue

        try:
            return await self._call(self.validation.read, self.server_id, count=count, block_ms=0)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.validation = ValidationQueue(self.client, self.keys, claim_idle_ms=self.cfg.buffer.claim_idle_ms)
            return []

    async def finish_val(self, item, result) -> None:
        """Report one evaluation prompt's scored samples (to the validation results, never the trajectories)."""
        await self._call(self.validation.finish, item, result)

    async def ack(self, entry_ids: list[str]) -> None:
        await self._call(self.prompts.ack, entry_ids)

    async def put(self, group: GroupData) -> bool:
        """Write one group; False when the buffer already holds its group_id (a retried prompt).

        Groups handed in while an earlier write is in flight wait for it and then go together, in one
        ``put_many`` (one Redis round trip, each group still its own idempotent insert)."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        self._to_put.append((group, done))
        if self._putter is None or self._putter.done() or self._putter.get_loop() is not loop:
            self._putter = asyncio.create_task(self._put_waiting())
        return await done

    async def _put_waiting(self) -> None:
        timeout_s = self.cfg.buffer.put_timeout_s
        while self._to_put:
            batch, self._to_put = self._to_put, []
            try:
                await self._put_batch(batch, timeout_s)
            finally:  # cancelled (the server stops): its callers are told rather than left waiting
                for _, done in batch:
                    if not done.done():
                        done.cancel()

    async def _put_batch(self, batch: list[tuple[GroupData, asyncio.Future[bool]]], timeout_s: float) -> None:
        from buffer import BufferFull

        results: list[bool | Exception]
        try:
            ids = await self._call(self.writer.put_many, [g for g, _ in batch], timeout_s=timeout_s)
            results = [i is not None for i in ids]
        except BufferFull as full:
            # The buffer stayed full for the whole timeout: the groups it did take are in (True), or were
            # there already (False); the others get the error, and their callers wait and retry.
            results = [(full.decided[k] is not None) if k in full.decided else full for k in range(len(batch))]
        except Exception:
            # A malformed group (refused before Redis is touched) or Redis away: each group on its own,
            # so each caller gets its own answer.
            results = []
            for g, _ in batch:
                try:
                    results.append(await self._call(self.writer.put, g, timeout_s=timeout_s) is not None)
                except Exception as e:
                    results.append(e)
        for (_, done), result in zip(batch, results, strict=True):
            if done.done():  # its caller was cancelled
                continue
            if isinstance(result, Exception):
                done.set_exception(result)
            else:
                done.set_result(result)

    async def dead_letter(self, *, reason: str, data: bytes, counter: str = "") -> None:
        """Park work that cannot be completed, with why, where an operator (and ``tether status``) sees it;
        counted, so the prompt's admission slot goes back to the learner (see :mod:`buffer.dead_letter`)."""
        from buffer import dead_letter

        await self._call(
            dead_letter, self.client, self.keys, source=self.source, reason=reason, data=data,
            maxlen=self.cfg.buffer.dead_letter_maxlen, **({"counter": counter} if counter else {}),
        )  # fmt: skip

    async def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to one of the run's counters (shown by ``buffer_stats`` and ``tether status``)."""
        await self._call(self.client.hincrby, self.keys.counters, counter, n)

    @property
    def source(self) -> str:
        return f"rollout:{self.server_id}"

    async def heartbeat(self, *, address: str, engine: str, policy_version: int, extra: dict) -> None:
        from buffer import ServerInfo

        info = ServerInfo(self.server_id, address=address, engine=engine, policy_version=policy_version, extra=extra)
        await self._call(self.registry.heartbeat, info, ttl_s=3 * self.cfg.rollout.heartbeat_s, pool=self._beat)

    async def published_version(self) -> int:
        """The policy version the learner last published (0 before the first)."""
        from buffer import read_version

        return await self._call(read_version, self.client, self.keys)

    async def weights_announced(self) -> dict | None:
        """The store transport's announced version (``buffer.weights``), None before the first."""
        from buffer.weights import read_announcement

        return await self._call(read_announcement, self.client, self.keys)

    async def weights_held(self) -> dict:
        """What each live server (this one included, heartbeat or not) holds: id -> ``buffer.weights.Held``."""
        from buffer.weights import held_versions

        live = {info.server_id for info in await self._call(self.registry.live)} | {self.server_id}
        return await self._call(held_versions, self.client, self.keys, sorted(live))

    async def record_weights(self, version: int, peer: str) -> None:
        from buffer.weights import Held, record_held

        await self._call(record_held, self.client, self.keys, self.server_id, Held(version, peer))

    async def forget_weights(self) -> None:
        from buffer.weights import forget_held

        await self._call(forget_held, self.client, self.keys, self.server_id)

    async def run_ended(self) -> dict | None:
        """What the learner published when the run finished (step, version), or None while it goes on."""
        from buffer.health import run_ended

        return await self._call(run_ended, self.client, self.keys)

    async def remove(self) -> None:
        await self._call(self.registry.remove, self.server_id)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._beat.shutdown(wait=False, cancel_futures=True)
        self.client.close()
