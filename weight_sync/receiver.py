"""The rollout server's side of a weight update: the state machine behind the Control RPCs.

The rollout server's Control servicer calls these coroutines; they pause and resume what the weights are
loaded into (a :class:`~weight_sync.loading.WeightLoader`: the server's engine), drive the transfer and
the load through a :class:`~weight_sync.loading.Delivery` (by default :class:`~weight_sync.inbox.LocalDelivery`:
received here, handed to ``loader.load_weights``; the engine may bring its own, as vLLM does) and set
``policy_version``. The receiver protects the server from a learner that goes away: after
Prepare it arms a watchdog, and if neither Commit nor Abort comes within the sum of the stage deadlines
it abandons the update and resumes serving on its current weights. A failed transfer falls back to the
filesystem snapshot of the same version when the learner wrote one, so a survivor of a broken group
still reaches the new version.

    receiver = WeightReceiver(loader, cfg)      # the rollout server passes its engine's own delivery too
    await receiver.catch_up()                   # at start: newest snapshot, if newer than model.path
    await receiver.prepare(plan); await receiver.commit(req)   # or: await receiver.abort(req)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from tether.config import TetherConfig
from tether.logs import get_logger
from tether.trajectory import MAX_POLICY_VERSION
from tether.v1 import control_pb2
from weight_sync.buckets import dtype_from_name, tensor_bytes
from weight_sync.inbox import LocalDelivery
from weight_sync.loading import PARTIAL_UPDATE, Delivery, WeightLoader, inflight_policy
from weight_sync.snapshot import latest_snapshot, snapshot_root

log = get_logger(__name__)


class WeightSyncError(RuntimeError):
    """A stage of the update failed on this server; the servicer reports it to the learner."""


class WeightReceiver:
    def __init__(self, loader: WeightLoader, cfg: TetherConfig, *, delivery: Delivery | None = None) -> None:
        self.loader = loader
        self.cfg = cfg
        self.wcfg = cfg.weight_sync
        self.delivery = delivery if delivery is not None else LocalDelivery(loader, cfg)
        self._plan: control_pb2.WeightUpdatePlan | None = None
        self._paused = False
        self._lock = asyncio.Lock()
        self._watchdog: asyncio.TimerHandle | None = None

    @property
    def updating(self) -> bool:
        """An update (or a catch-up) holds the engine paused: only it resumes the engine."""
        return self._paused

    @property
    def version(self) -> int:
        return int(self.loader.policy_version)

    def _snapshot_root(self) -> Path | None:
        try:
            return snapshot_root(self.cfg)
        except ValueError:  # no run_id: nothing to catch up from
            return None

    async def prepare(self, plan: control_pb2.WeightUpdatePlan) -> control_pb2.PrepareWeightUpdateResponse:
        _validate(plan)
        async with self._lock:
            if plan.version <= self.version:
                return control_pb2.PrepareWeightUpdateResponse(current_version=self.version, ready=False)
            if self._plan is not None and self._plan.update_id != plan.update_id:
                await self._drop("superseded by a newer update")
            if not self._paused:
                inflight = inflight_policy(plan.inflight, self.wcfg.inflight)
                await self.loader.pause(inflight)
                self._paused = True
            # The same update may be prepared twice (the learner re-plans survivors under a new epoch).
            self._plan = plan
            await self.delivery.start(plan)
            self._arm_watchdog(plan.update_id)
            log.info(
                "weight_update_prepared",
                version=plan.version,
                update_id=plan.update_id,
                source=plan.WhichOneof("source"),
            )
            return control_pb2.PrepareWeightUpdateResponse(current_version=self.version, ready=True)

    async def commit(self, req: control_pb2.CommitWeightUpdateRequest) -> control_pb2.CommitWeightUpdateResponse:
        async with self._lock:
            plan = self._plan
            if plan is None or plan.update_id != req.update_id:
                raise WeightSyncError(f"commit of update {req.update_id!r}, which this server has not prepared")
            start = time.perf_counter()
            version = plan.version
            try:
                tally = await self.delivery.finish(plan, timeout_s=self.wcfg.commit_timeout_s)
                nbytes, sums = tally.bytes, tally.checksums
            except Exception as exc:
                log.warning("weight_transfer_failed", version=version, error=repr(exc))
                try:
                    loaded = await self._load_snapshot(min_version=version)
                except Exception as again:  # the snapshot would not load either: serve the old weights
                    if PARTIAL_UPDATE in str(exc) or PARTIAL_UPDATE in str(again):  # ... if they are still whole
                        restored = await self._restore_after_partial(version, again)
                        raise WeightSyncError(
                            f"update {version}: transfer failed ({exc!r}) and so did its snapshot ({again!r}), one"
                            f" of them half-way through the load; {restored}"
                        ) from exc
                    await self._drop(f"transfer failed: {exc!r}; snapshot failed: {again!r}")
                    raise WeightSyncError(
                        f"update {version}: transfer failed ({exc!r}) and so did its snapshot ({again!r})"
                    ) from exc
                if loaded is None and PARTIAL_UPDATE in str(exc):
                    # A streamed load stopped half-way: the old weights are gone too. Any snapshot makes the
                    # model one version again (an older one, and said so); with none it stays mixed.
                    restored = await self._restore_after_partial(version, exc)
                    raise WeightSyncError(
                        f"update {version}: transfer failed half-way through the load ({exc!r}); {restored}"
                    ) from exc
                if loaded is None:
                    await self._drop(f"transfer failed: {exc!r}")
                    raise WeightSyncError(f"update {version}: transfer failed ({exc!r}) and no snapshot") from exc
                version, nbytes, sums = loaded
            self.loader.policy_version = version
            self._plan = None
            await self._resume()
            seconds = time.perf_counter() - start
            log.info("weight_update_loaded", version=version, bytes=nbytes, seconds=round(seconds, 3))
            return control_pb2.CommitWeightUpdateResponse(
                policy_version=version, bytes_received=nbytes, load_seconds=seconds, checksums=sums
            )

    async def abort(self, req: control_pb2.AbortWeightUpdateRequest) -> control_pb2.AbortWeightUpdateResponse:
        async with self._lock:
            if self._plan is not None and (not req.update_id or req.update_id == self._plan.update_id):
                await self._drop(req.reason or "aborted by the learner")
            return control_pb2.AbortWeightUpdateResponse(policy_version=self.version)

    async def catch_up(self) -> int:
        """Load the newest complete snapshot when it is newer than the engine's weights; returns the version."""
        async with self._lock:
            paused_here = not self._paused
            if paused_here:
                await self.loader.pause(self.wcfg.inflight)
                self._paused = True
            try:
                loaded = await self._load_snapshot(min_version=self.version + 1)
                if loaded is not None:
                    self.loader.policy_version = loaded[0]
                    log.info("weights_caught_up", version=loaded[0], bytes=loaded[1])
            finally:
                if paused_here and self._plan is None:
                    await self._resume()
            return self.version

    async def _load_snapshot(self, *, min_version: int) -> tuple[int, int, dict[str, float]] | None:
        root = self._snapshot_root()
        found = latest_snapshot(root) if root is not None else None
        if found is None or found[0] < min_version:
            return None
        tally = await self.delivery.load_snapshot(found[1], version=found[0])
        return found[0], tally.bytes, tally.checksums

    async def _restore_after_partial(self, version: int, exc: Exception) -> str:
        try:
            loaded = await self._load_snapshot(min_version=0)
        except Exception as again:
            loaded, why = None, f"its snapshot failed too ({again!r})"
        else:
            why = "no snapshot to restore from"
        if loaded is not None:
            self.loader.policy_version = loaded[0]
            await self._drop(f"transfer failed half-way: restored snapshot {loaded[0]}")
            return f"restored snapshot version {loaded[0]}"
        log.error("weights_mixed", version=version, serving=self.version, error=repr(exc), why=why)
        await self._drop(f"transfer failed half-way, {why}: the weights mix versions {self.version} and {version}")
        return f"{why}: the weights mix versions until the next update"

    async def _drop(self, reason: str) -> None:
        plan, self._plan = self._plan, None
        if plan is not None:
            log.warning("weight_update_dropped", version=plan.version, update_id=plan.update_id, reason=reason)
            with contextlib.suppress(Exception):
                await self.delivery.cancel()
        await self._resume()

    async def _resume(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._paused:
            await self.loader.resume()
            self._paused = False

    def _arm_watchdog(self, update_id: str) -> None:
        # A learner that dies between Prepare and Commit must not leave this server paused for good.
        if self._watchdog is not None:
            self._watchdog.cancel()
        wcfg = self.wcfg
        delay = wcfg.prepare_timeout_s + wcfg.transfer_timeout_s + wcfg.commit_timeout_s
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(delay, lambda: loop.create_task(self._expire(update_id)))

    async def _expire(self, update_id: str) -> None:
        async with self._lock:
            if self._plan is not None and self._plan.update_id == update_id:
                await self._drop("no commit from the learner before the deadline")


def _validate(plan: control_pb2.WeightUpdatePlan) -> None:
    """Reject a malformed plan before pausing anything (the servicer maps ValueError to INVALID_ARGUMENT)."""
    if plan.WhichOneof("source") is None:
        raise ValueError("WeightUpdatePlan.source: set filesystem or collective")
    if not plan.update_id:
        raise ValueError("WeightUpdatePlan.update_id is empty")
    if not 0 < plan.version <= MAX_POLICY_VERSION:
        # Every token carries its version in the buffer as int32; a larger one would be accepted here and
        # then fail each episode close and trajectory write after the commit.
        raise ValueError(f"WeightUpdatePlan.version {plan.version} is outside 1..{MAX_POLICY_VERSION}")
    for meta in plan.tensors:
        dtype_from_name(meta.dtype)
        if meta.bucket >= len(plan.buckets):
            raise ValueError(f"WeightUpdatePlan.tensors[{meta.name}].bucket {meta.bucket} has no bucket")
        end = meta.offset_bytes + tensor_bytes(meta)
        if end > plan.buckets[meta.bucket].num_bytes:
            raise ValueError(
                f"WeightUpdatePlan.tensors[{meta.name}] ends at byte {end}, past its bucket "
                f"({plan.buckets[meta.bucket].num_bytes} bytes)"
            )
    if plan.HasField("collective") and not 0 < plan.collective.rank < plan.collective.world_size:
        raise ValueError("WeightUpdatePlan.collective.rank must be in 1..world_size-1")
