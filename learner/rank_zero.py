"""What only learner rank 0 does: everything that talks to Redis.

Rank 0 owns the data order (the prompt feed and the trajectory reader), acknowledges what a step trained
on, records the version the servers hold, runs evaluation rounds, keeps the live status and the group
trace, and writes the run's books at the end. The other ranks learn what they need from it by broadcast:
the step's groups with one word (:data:`GO_ON`, :data:`FAILED`, :data:`STOP_ASKED`, :data:`CANNOT_TRAIN`),
the resumed version and the dataset position (:mod:`learner.distributed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from buffer import publish_version, read_version
from buffer.health import clear_run_end, publish_run_end
from buffer.keys import RedisKeys
from buffer.ledger import LedgerSnapshot, take_snapshot, write_books
from buffer.run_config import publish_run_config
from learner.checkpoint import TrainState, checkpoint_step, latest_checkpoint
from learner.feed import CannotTrain, DataTimeout, Feed
from learner.generation_log import GenerationLog
from learner.group_trace import GroupTrace
from learner.lifecycle import StopSignal, plan_resume_version, refuse_fresh_start
from learner.telemetry import LiveStatus
from tether.config import TetherConfig
from tether.logs import get_logger
from tether.metrics import MetricsLogger
from tether.redis_server import RedisUnavailable, connect_redis
from tether.runs import RunPaths
from weight_sync.snapshot import latest_snapshot

if TYPE_CHECKING:
    from learner.evaluation import Evaluator

log = get_logger(__name__)

# Rank 0's word to every rank with each batch: train it, stop on a failure, stop because asked to, or stop
# because the run cannot train (every group wasted: the state is whole, so it is checkpointed as for a stop).
GO_ON, FAILED, STOP_ASKED, CANNOT_TRAIN = 0, 1, 2, 3


class RankZero:
    """Rank 0's connection to the run's Redis and what hangs off it (built once, before the first step).

    On resume it also decides the version to continue from (:func:`learner.lifecycle.plan_resume_version`)
    and sets ``state.version`` and :attr:`republish`; every rank then agrees on them.
    """

    def __init__(self, cfg: TetherConfig, paths: RunPaths, state: TrainState, *, resume: bool) -> None:
        if not cfg.buffer.redis_url:
            raise ValueError("buffer.redis_url is empty: start the learner with `tether up`, or give a Redis URL")
        self.cfg = cfg
        self.client = connect_redis(cfg.buffer.redis_url)
        self.republish = False
        """Publish the checkpoint's weights under the resumed version before any prompt is fed."""
        if resume:
            snap = latest_snapshot(paths.snapshots)
            plan = plan_resume_version(state.version, published=read_version(self.client, RedisKeys(cfg.run.run_id)),
                                       snapshot=snap[0] if snap else None)  # fmt: skip
            log.info("resume_version", checkpoint=state.version, version=plan.version, publish=plan.publish,
                     reason=plan.reason)  # fmt: skip
            state.version, self.republish = plan.version, plan.publish
        else:
            ckpt = latest_checkpoint(paths.checkpoints)
            refuse_fresh_start(cfg.run.run_id, published=read_version(self.client, RedisKeys(cfg.run.run_id)),
                               checkpoint_step=checkpoint_step(ckpt) if ckpt else None,
                               folder=str(paths.root))  # fmt: skip
        self.feed = Feed(cfg, self.client, data_position=state.data_position, step=state.step, version=state.version,
                         ledger=LedgerSnapshot.from_json(state.ledger))  # fmt: skip
        self.keys = self.feed.keys
        clear_run_end(self.client, self.keys)  # a resumed run is not over, whatever a lifetime before published
        publish_run_config(self.client, self.keys, cfg.model_dump(mode="json"))  # for fleets serving several runs
        lc = cfg.learner
        self.live = LiveStatus(client=self.client, key=self.keys.learner, port=lc.metrics_port,
                               total_steps=lc.total_steps, start_step=state.step)  # fmt: skip
        self.trace = GroupTrace(paths.root / "groups.jsonl")
        self.generations = GenerationLog(cfg, paths.root, client=self.client, keys=self.keys, source=self.feed.source)
        self.evaluator: Evaluator | None = None  # with learner.val_data_path, once started
        self.cannot_train: str | None = None
        """Why the run cannot train (:class:`learner.feed.CannotTrain`), once the feed gave up."""

    # ----- versions

    def published_version(self) -> int:
        return read_version(self.client, self.keys)

    def record_version(self, version: int) -> None:
        publish_version(self.client, self.keys, version)

    def version_committed(self, version: int) -> None:
        """On the publication thread, the moment the servers hold ``version``: record it, and admit the
        prompts it allows right away (in sync mode that happens before the next step, so must this)."""
        self.record_version(version)
        try:
            self.feed.feed(version)
        except redis.RedisError as e:  # the next read feeds again; nothing is lost by waiting for it
            log.warning("redis_unavailable", during="feed after publish", error=str(e))

    # ----- each step

    def next_batch(
        self, version: int, stop_signal: StopSignal, servers_version: Callable[[], int], *, last: bool = False
    ) -> tuple[list, int]:
        """The step's groups (buffered entries) and the word for every rank; ``last``: the run's final step."""
        batch, stop = [], GO_ON
        try:
            batch = self.feed.next_batch(
                version, stop_requested=lambda: stop_signal.requested, admission_version=servers_version, last=last
            )
        except CannotTrain as e:
            log.error("cannot_train", reason=str(e))
            self.cannot_train, stop = str(e), CANNOT_TRAIN
        except DataTimeout as e:
            log.error("data_timeout", error=str(e))
            stop = FAILED
        if stop == GO_ON and stop_signal.requested:
            stop = STOP_ASKED
        return batch, stop

    def trained(self, batch: list, samples: list, *, step: int, version: int) -> dict[str, float]:
        """After the optimizer step that used ``batch`` (step ``step``, at learner version ``version``; its
        ``samples`` as the trainer trained them): acknowledge and trace it, and keep the viewer's record of it;
        the admission metrics, the length book, and how long the step waited for groups about to expire."""
        self.feed.ack(batch)
        self.trace.write(batch, step=step)
        self.generations.trained(batch, samples, step=step, version=version)
        return {
            **self.feed.admission_metrics(),
            **self.feed.length_metrics(),
            "timing/wait_stale": self.feed.stale_wait_s,
        }

    def after_step(self, step: int, version: int, row: dict[str, float], *, servers_version: int) -> None:
        self.live.update(step, version, row)
        if self.evaluator is not None:  # asynchronous: results of earlier rounds are logged as they arrive
            self.evaluator.poll()
            # The version the servers hold: one behind the learner's while a publication is in flight.
            self.evaluator.maybe_start(step, servers_version)

    def start_evaluation(self, metrics: MetricsLogger, *, step: int, version: int) -> None:
        from learner.evaluation import Evaluator

        self.evaluator = Evaluator(self.cfg, self.client, self.keys, metrics)
        self.evaluator.maybe_start(step, version)  # val_before_train

    # ----- checkpoints and the end

    def books(self) -> str | None:
        """The buffer's books for a checkpoint; None (and a warning) when Redis cannot give them."""
        try:
            return take_snapshot(self.client, self.keys).to_json()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            # The weights are still worth keeping; a resume onto a Redis that lost the run then has no
            # books to restore, and says so.
            log.warning("checkpoint_without_books", error=str(e))
            return None

    def mark_run_end(self, *, step: int, version: int) -> None:
        try:  # rollout servers started by hand idle or exit (rollout.exit_when_run_ends)
            publish_run_end(self.client, self.keys, step=step, version=version)
        except redis.RedisError as e:
            log.warning("run_end_not_published", error=str(e))

    def close(self, paths: RunPaths) -> None:
        self.feed.release()  # before the books are written: nothing untrained left pending on this learner
        self.live.close()
        self.generations.close()
        _write_books(self.cfg, self.keys, paths.root / "buffer_stats.json")


def _write_books(cfg: TetherConfig, keys: RedisKeys, path) -> None:  # type: ignore[no-untyped-def]
    """The books at the learner's end, in every mode (also without ``tether up``); a fresh client with a short
    timeout, so a Redis that went away first cannot hold the exit up for the retry budget."""
    try:
        client = connect_redis(cfg.buffer.redis_url, timeout_s=2.0)
    except RedisUnavailable as e:
        log.warning("buffer_books_not_saved", error=str(e))
        return
    client.set_retry(Retry(NoBackoff(), 0))
    write_books(client, keys, path)
    client.close()
