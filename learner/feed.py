"""Rank 0's side of the buffer: prompts in under admission control, one step's groups out.

The dataset position resumes from the larger of the checkpoint's and the buffer's ``issued`` counter:
when Redis outlived the learner, the prompts issued after the checkpoint are still in the prompts
stream (or already answered in the trajectories stream), so issuing them again would repeat data.
When Redis did not keep the run, the checkpoint's books are put back first and the prompts that were
outstanding at the checkpoint are reissued once (:mod:`buffer.ledger`).

While it waits for groups it says why none come (:class:`buffer.health.RunWatch`), and gives up with
:class:`CannotTrain` when every group of ``learner.stuck_timeout_s`` was wasted
(:class:`buffer.health.StallWatch`): waiting longer cannot help, and restarting the learner would not either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis

from buffer import BufferedGroup, PromptQueue, RedisKeys, TrajectoryReader
from buffer.health import RunWatch, StallWatch
from buffer.ledger import LedgerSnapshot, begin_lifetime, restore
from buffer.lengths import LengthBook
from buffer.replies import str_keys
from learner.data import PromptSource
from tether import spans
from tether.config import TetherConfig
from tether.logs import get_logger

log = get_logger(__name__)


class DataTimeout(RuntimeError):
    """No trajectory group arrived within ``learner.read_timeout_s``."""


class CannotTrain(DataTimeout):
    """Every group of the last ``learner.stuck_timeout_s`` was dead-lettered or dropped: the message says the
    most common reason and the setting to check."""


class Feed:
    def __init__(
        self,
        cfg: TetherConfig,
        client,
        *,
        data_position: int,
        step: int = 0,
        version: int = 0,
        ledger: LedgerSnapshot | None = None,
    ) -> None:
        self.cfg = cfg
        self.keys = RedisKeys(cfg.run.run_id)
        # Before any stream or group is (re)created: Redis may have lost the run, or be older than the checkpoint.
        reissue = restore(client, self.keys, ledger)
        self.queue = PromptQueue(client, self.keys, claim_idle_ms=cfg.buffer.claim_idle_ms)
        self.reader = TrajectoryReader(client, self.keys, cfg.buffer, consumer="learner-0")
        start = max(data_position, self.queue.issued())
        # No dataset: every group comes from custom environments driving episodes (nothing to feed).
        self.source = PromptSource(cfg, start=start) if cfg.learner.data_path else None
        self.lifetime = begin_lifetime(client, self.keys, step=step, version=version)
        if reissue and self.source is not None:
            self.queue.reissue(self.source.prompts_at(reissue), version=version)
        recovered = self.reader.recover()
        self.prompts_per_version = cfg.learner.train_batch_size * cfg.weight_sync.sync_every
        self.client, self.watch, self._watched_at = client, RunWatch(cfg), 0.0
        lc = cfg.learner
        self.stall = StallWatch(cfg, timeout_s=lc.stuck_timeout_s, min_groups=lc.train_batch_size)
        self._feed_lock = threading.Lock()
        self.redis_errors = 0  # Redis calls that failed even after the client's retries (logged each time)
        self.stale_wait_s = 0.0  # the last step's wait for groups about to pass max_staleness
        log.info(
            "feed_started", dataset_position=start, recovered_groups=recovered, reissued_prompts=len(reissue),
            lifetime=self.lifetime,
        )  # fmt: skip

    @property
    def position(self) -> int:
        return self.source.position if self.source is not None else 0

    def feed(self, version: int) -> int:
        """Issue what admission allows at ``version``. Thread-safe: a background weight publication feeds
        the moment its version is committed, while the learner's own thread may be reading."""
        if self.source is None:
            return 0
        with self._feed_lock:
            return self.queue.feed(
                self.source,
                version=version,
                prompts_per_version=self.prompts_per_version,
                max_staleness=self.cfg.algorithm.max_staleness,
            )

    def admission_metrics(self) -> dict[str, float]:
        """The admission count after the last feed, beside the bound it was held to (so a run's metrics show
        it held). The bound is the one of the version that feed counted from, read with it: a background
        publication may feed at a newer version between a step's reading the servers' version and this."""
        admission = self.queue.admission  # replaced whole by each feed: one consistent snapshot
        if not admission:
            return {}
        bound = (self.cfg.algorithm.max_staleness + admission["version"] + 1) * self.prompts_per_version
        issued, given_back = admission["prompts_issued"], admission["prompts_given_back"]
        return {
            "buffer/prompts_issued": float(issued),
            "buffer/prompts_given_back": float(given_back),
            "buffer/admission_bound": float(bound + given_back),
        }

    def length_metrics(self) -> dict[str, float]:
        """The run's length book so far (:mod:`buffer.lengths`): TV distance between the lengths generated and
        the lengths trained, both means, and the share dropped per length bucket. One HGETALL."""
        try:
            raw = str_keys(self.client.hgetall(self.keys.lengths))
        except redis.RedisError as e:  # metrics only: the next step reads it again
            log.warning("redis_unavailable", during="length book", error=str(e))
            return {}
        return LengthBook.from_hash(raw).metrics()

    def next_batch(
        self,
        version: int,
        *,
        stop_requested: Callable[[], bool] | None = None,
        admission_version: Callable[[], int] | None = None,
        last: bool = False,
    ) -> list[BufferedGroup]:
        """Exactly ``train_batch_size`` usable groups (waits for them; feeds prompts while waiting); fewer
        when ``stop_requested`` turns true meanwhile — those stay unacknowledged for the next lifetime.

        ``version`` is the learner's (staleness of what it reads); ``admission_version()`` the newest version
        the servers are known to hold (default: ``version``). They differ while a publication is in flight:
        prompts issued then are generated by the older weights, so admission counts from those. The ``last``
        step of a lifetime does not wait for groups about to pass the bound: no later step would train them.
        """
        want = self.cfg.learner.train_batch_size
        timeout = self.cfg.learner.read_timeout_s
        got: list[BufferedGroup] = []
        last_progress = time.monotonic()
        while len(got) < want:
            if stop_requested is not None and stop_requested():
                return got
            try:
                self.feed(version if admission_version is None else admission_version())
                new = self.reader.read(
                    want - len(got), current_version=version, max_staleness=self.cfg.algorithm.max_staleness,
                    block_ms=500,
                )  # fmt: skip
            except (redis.ConnectionError, redis.TimeoutError) as e:
                # Redis is down for longer than the client's own retries: wait for it (read_timeout_s still
                # bounds the wait). What was read before stays pending on this consumer, so nothing is lost.
                self.redis_errors += 1
                log.warning("redis_unavailable", during="read", errors=self.redis_errors, error=str(e))
                new = []
                time.sleep(1.0)
            if new:
                got.extend(new)
                last_progress = time.monotonic()
                self.stall.usable()
                continue
            self._explain_wait()
            if timeout and time.monotonic() - last_progress > timeout:
                raise DataTimeout(
                    f"no trajectory group for {timeout:.0f}s (learner.read_timeout_s) — are rollout servers running "
                    f"for run {self.cfg.run.run_id!r}?"
                )
        return self._with_due(
            got, version, stop_requested=stop_requested, admission_version=admission_version, last=last
        )

    def _with_due(
        self,
        got: list[BufferedGroup],
        version: int,
        *,
        stop_requested: Callable[[], bool] | None,
        admission_version: Callable[[], int] | None,
        last: bool,
    ) -> list[BufferedGroup]:
        """The step's batch, with every group that would be too old for the next step in it: waits (up to
        ``algorithm.stale_wait_s``) for the prompts issued ``max_staleness`` versions ago that a server is still
        generating, then takes the oldest ``train_batch_size`` of all that arrived and gives the rest back
        to the reader for the next step. Without this the long completions — the last to arrive — were the
        ones the bound dropped (docs/STALENESS.md)."""
        algo, want = self.cfg.algorithm, self.cfg.learner.train_batch_size
        self.stale_wait_s = 0.0
        if last or not algo.stale_wait_s or len(got) < want or self.source is None:
            return got
        issued_by = version - algo.max_staleness  # issued then or before: stale at the next version
        started = time.monotonic()
        try:
            due = self.queue.generating(issued_by=issued_by)
            if due:  # the timeline shows the wait (tether trace), the step's metrics its length
                with spans.span("wait_stale", groups=due):
                    while due and time.monotonic() - started < algo.stale_wait_s:
                        if stop_requested is not None and stop_requested():
                            return got
                        self.feed(version if admission_version is None else admission_version())
                        time.sleep(0.05)
                        due = self.queue.generating(issued_by=issued_by)
                self.stale_wait_s = time.monotonic() - started
                # what arrived meanwhile, the awaited groups among it
                got += self.reader.read(self.cfg.buffer.max_trajectory_groups, current_version=version,
                                        max_staleness=algo.max_staleness, block_ms=0)  # fmt: skip
        except (redis.ConnectionError, redis.TimeoutError) as e:  # train on what is here; nothing is lost
            self.redis_errors += 1
            log.warning("redis_unavailable", during="stale wait", errors=self.redis_errors, error=str(e))
        got.sort(key=lambda b: b.group.oldest_version)  # stable: arrival order among equals
        self.reader.give_back(got[want:])
        return got[:want]

    def release(self) -> None:
        """At the lifetime's end: what the reader took and did not train goes back to the stream, undelivered
        (:meth:`buffer.TrajectoryReader.release`). Without Redis it stays pending here, and the next lifetime's
        recovery takes it back, so nothing is lost either way."""
        try:
            released = self.reader.release()
        except redis.RedisError as e:
            log.warning("redis_unavailable", during="release", error=str(e))
            return
        if released:
            log.info("buffer_released", groups=released)

    def _explain_wait(self) -> None:
        """While no group comes, say why (no server, all dead-lettered, all stale) — a learner started by
        hand has no ``tether up`` console to do it — and raise :class:`CannotTrain` once the run cannot train.
        A check every 2 s; RunWatch rate-limits the words."""
        now = time.monotonic()
        if now - self._watched_at < 2.0:
            return
        self._watched_at = now
        try:
            for message in self.watch.check(self.client):
                log.warning("not_training", cause=message)
            stuck = self.stall.check(self.client, now=now)
        except redis.RedisError:
            return  # the read above reports Redis outages
        if stuck is not None:
            raise CannotTrain(stuck)

    def ack(self, batch: list[BufferedGroup]) -> None:
        """Acknowledge after the optimizer step; over a Redis outage, keep trying for read_timeout_s
        (a repeated ack is a no-op), then raise — the groups stay pending and a resumed run retrains them."""
        deadline = time.monotonic() + (self.cfg.learner.read_timeout_s or 300)
        while True:
            try:
                self.reader.ack([b.entry_id for b in batch])
                return
            except (redis.ConnectionError, redis.TimeoutError) as e:
                self.redis_errors += 1
                log.warning("redis_unavailable", during="ack", errors=self.redis_errors, error=str(e))
                if time.monotonic() > deadline:
                    raise
                time.sleep(1.0)
