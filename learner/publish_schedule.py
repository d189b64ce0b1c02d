"""The learner's weight publications: version v+1 every ``weight_sync.sync_every`` steps, off the critical
path when the staleness bound allows.

With ``max_staleness`` ≥ 1 (and ``weight_sync.async_publish``) version v+1 is packed at once and sent while
step v+2 trains; it is waited for at the end of that step (at most one in flight). Its step's metrics row
waits for it (logged once its report is in), so every row still carries its own update. Admission counts
from the version the servers are known to hold (:attr:`PublishSchedule.published`), and the prompts a new version
allows are fed the moment its commit is over, from the publication thread. All ranks call :meth:`publish`
(gathering from FSDP2 shards is a collective); rank 0 alone records versions in Redis.
"""

from __future__ import annotations

import contextlib
import time

import torch

from buffer import ServerRegistry
from buffer.weights import announce_weights, held_versions
from learner.lora import adapter_params, is_lora
from learner.rank_zero import RankZero
from learner.telemetry import nvtx
from tether.config import TetherConfig
from tether.metrics import MetricsLogger
from weight_sync.publishers import make_publisher


class PublishSchedule:
    """The learner's side of its publications, around its steps: each one is sent by a
    :class:`weight_sync.publication.WeightPublisher` (``sender``), in the background when allowed; rank 0
    records the versions in Redis and holds a step's metrics row until its publication lands."""

    def __init__(
        self,
        cfg: TetherConfig,
        model: torch.nn.Module,
        *,
        rank: int,
        world: int,
        zero: RankZero | None,
        metrics: MetricsLogger,
    ) -> None:
        self.zero, self.metrics = zero, metrics
        registry = ServerRegistry(zero.client, zero.keys) if zero is not None else None
        params = adapter_params(model) if is_lora(model) else None  # LoRA: updates carry the adapters only
        self.sender = make_publisher(
            cfg, model=model, params=params, rank=rank, world_size=world, registry=registry,
            announce=self._announce if zero is not None else None, fleet=self._fleet if zero is not None else None,
        )  # fmt: skip
        self.registry = registry
        self.background_ok = cfg.weight_sync.async_publish and cfg.algorithm.max_staleness >= 1
        """Whether a publication may be sent while the next step trains."""
        self.published = 0
        """The newest version the servers are known to hold (admission counts from it)."""
        self._pending: tuple[int, dict[str, float]] | None = None  # (step, metrics) of the publication in flight

    def start(self, version: int, *, republish: bool) -> None:
        """Before any prompt is fed: with ``republish`` every server generates from the checkpoint's weights."""
        if republish or self.sender.base_at_start:
            # The store always starts from a base of the starting weights: deltas need a version every
            # server can hold (a fresh run's v0 included), and versions after it are a lost timeline.
            self.sender.publish(version, snapshot=True)
        zero = self.zero
        if zero is not None and (republish or zero.published_version() < version):
            zero.record_version(version)
        self.published = version

    def _announce(self, info: dict) -> None:
        assert self.zero is not None
        announce_weights(self.zero.client, self.zero.keys, info)

    def _fleet(self) -> dict[str, int]:
        """The version each live server holds (store transport: what a publication waits for)."""
        assert self.zero is not None and self.registry is not None
        live = [s.server_id for s in self.registry.live()]
        return {sid: held.version for sid, held in held_versions(self.zero.client, self.zero.keys, live).items()}

    def publish(self, version: int, *, background: bool) -> dict[str, float]:
        """Publish the weights as ``version`` (on every rank); the report on rank 0 when not in the background."""
        zero = self.zero
        with nvtx("publish", version=version):
            report = self.sender.publish(
                version, background=background, on_done=self._committed if zero is not None else None
            )
        if zero is None or background:
            return {}
        self.published = version
        zero.record_version(version)
        return report

    def _committed(self, report: dict[str, float]) -> None:
        """On the publication thread, the moment the servers hold the version."""
        assert self.zero is not None  # only rank 0 is called back
        self.published = int(report["weight_sync/version"])
        self.zero.version_committed(self.published)

    def log_row(self, step: int, row: dict[str, float], *, background: bool) -> None:
        """Log a step's metrics row (rank 0) — or, when its publication is in flight, hold it until it lands."""
        if background:
            self._pending = (step, row)
        elif self.zero is not None:
            self.metrics.log(row, step=step)

    def settle(self) -> float:
        """Wait for the publication in flight (if any), log its step's row; seconds waited."""
        if self._pending is None:
            return 0.0
        start = time.perf_counter()
        with nvtx("weight_sync_wait"):
            report = self.sender.wait()
        waited = time.perf_counter() - start
        step, row = self._pending
        self._pending = None
        if self.zero is not None:
            row.update(report)
            self.metrics.log(row, step=step)
        return waited

    def close(self) -> None:
        if self._pending is not None:  # a failing run still waits (bounded by the stage deadlines) and logs the row
            with contextlib.suppress(Exception):
                self.settle()
        self.sender.close()
