"""What every way of publishing the learner's weights shares: the dtype they travel in, and the lifecycle.

Two protocols publish a version: a *push* (:class:`weight_sync.sender.WeightSender`: gloo, NCCL or a
filesystem snapshot, with a prepare/commit handshake per server) and a *pull*
(:class:`weight_sync.store_publisher.StorePublisher`: the version is written once into the weight store
and the fleet fetches it). The learner drives either through :class:`WeightPublisher` —
``publish`` / ``wait`` / ``in_flight`` / ``last_dropped`` / ``close`` — and gets the one its config names
from :func:`weight_sync.publishers.make_publisher`; nothing outside ``weight_sync`` tells them apart.

A publication reads the model only while it is *staged* (on every rank: gathering from FSDP2 shards is a
collective); with ``background`` the rest — the transfer, the handshake, the wait for the fleet — runs on
one thread of rank 0 while the learner trains on. One publication is in flight at a time, so versions
reach every server in order.
"""

from __future__ import annotations

import concurrent.futures
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch

from tether.config import TetherConfig

Report = dict[str, float]
OnDone = Callable[[Report], None]
Deliver = Callable[[OnDone | None], Report]
"""Rank 0's rest of a publication once it is staged: ``deliver(on_done)`` returns the ``weight_sync/*`` report."""


def publish_dtype(cfg: TetherConfig, device: torch.device) -> str:
    """``weight_sync.publish_dtype`` resolved. ``auto``: what the engines serve, ``model.dtype``, whose own
    ``auto`` is bfloat16 where the learner's parameters are on CUDA and float32 elsewhere (the learner's
    device stands for the fleet's)."""
    name = cfg.weight_sync.publish_dtype
    if name == "auto":
        name = cfg.model.dtype
    if name == "auto":
        name = "bfloat16" if device.type == "cuda" else "float32"
    return name


def params_device(params: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    return params[0][1].device if params else torch.device("cpu")


class WeightPublisher(ABC):
    """The learner's side of a weight-update protocol (see the module docstring)."""

    base_at_start = False
    """Whether a run's first publication must be a full base even when it is not a resumed one (the store's
    deltas need a version every server can hold)."""

    def __init__(
        self,
        cfg: TetherConfig,
        *,
        model: torch.nn.Module,
        params: Sequence[tuple[str, torch.Tensor]] | None,
        rank: int,
        world_size: int,
    ) -> None:
        self.cfg, self.wcfg = cfg, cfg.weight_sync
        self.rank, self.world_size = rank, world_size
        # named_parameters() lists a tied weight once (embeddings / lm_head): it travels once.
        self._params = list(params) if params is not None else list(model.named_parameters())
        self.last_dropped: dict[str, str] = {}
        """The servers the last publication did not reach, with why."""
        self._background: tuple[int, concurrent.futures.Future] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-publish")

    @abstractmethod
    def _stage(self, version: int, *, snapshot: bool, background: bool, start: float) -> Deliver | None:
        """Every rank: read what this publication needs from the model (all of it when ``background``); rank 0
        returns the delivery, the other ranks None. ``snapshot``: the version is written whole (a resumed
        learner's first publication)."""

    def publish(
        self, version: int, *, snapshot: bool = False, background: bool = False, on_done: OnDone | None = None
    ) -> Report:
        """Publish the model's weights as ``version`` (call on every rank); rank 0 returns the report.

        ``background``: stage now (the caller may change the weights as soon as this returns), deliver on a
        thread of rank 0 and return ``{}`` at once; :meth:`wait` returns the report, and ``on_done(report)``
        runs on that thread the moment the servers hold the version. Call :meth:`wait` before the next one."""
        if self._background is not None:
            raise RuntimeError(
                f"weight_sync: publication of version {self._background[0]} is still in flight — wait() first"
            )
        deliver = self._stage(version, snapshot=snapshot, background=background, start=time.perf_counter())
        if deliver is None:
            return {}
        if background:
            self._background = (version, self._executor.submit(deliver, on_done))
            return {}
        return deliver(None)

    @property
    def in_flight(self) -> int | None:
        """The version a background publication is delivering (rank 0), None when none is."""
        return self._background[0] if self._background is not None else None

    def wait(self) -> Report:
        """Block until the background publication (if any) is over; its report on rank 0, else ``{}``."""
        if self._background is None:
            return {}
        _, future = self._background
        try:
            return future.result()
        finally:
            self._background = None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._executor.shutdown(wait=True)
            self._close()

    @abstractmethod
    def _close(self) -> None:
        """Release what the protocol holds beyond the publication thread (rank 0's transport, its chunk
        server)."""
