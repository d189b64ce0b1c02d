"""The receiving end of every transport: a plan's bytes in, named tensors out, in the process that loads them.

A ``WeightUpdatePlan`` says where its bytes come from in its ``source`` oneof; :data:`SOURCES` maps each
kind to the class that receives it (:class:`SourceReceiver`): ``collective`` joins the gloo/NCCL group
and receives every bucket in a background thread (``collective.py``), ``filesystem`` reads the snapshot
(``snapshot.py``). A new transport adds its class and one line here; nothing here knows what the tensors
are loaded into. :class:`Inbox` keeps the update in flight between Prepare and Commit.

:class:`LocalDelivery` is the usual :class:`~weight_sync.loading.Delivery`: receive in this process and
hand the tensors to a :class:`~weight_sync.loading.WeightLoader` (an engine's ``load_weights``). vLLM's
worker processes run an :class:`Inbox` of their own (``rollout_server/engines/vllm_worker.py``).

Received buckets are loaded at commit, not as they arrive, so a transfer that fails half-way never
leaves a model with a mix of two versions (the price: one model's worth of receive buffers). A loader that
cannot afford that (vLLM beside its KV cache) streams instead (:meth:`Inbox.stream`): each bucket is loaded
as it arrives, during the transfer, at most two buckets held; a transfer that fails half-way then leaves a
mixed model (:class:`~weight_sync.loading.PartialUpdate`), which the receiver replaces from a snapshot.
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.config import TetherConfig
from tether.v1 import control_pb2
from weight_sync.buckets import Layout, unpack
from weight_sync.collective import CollectiveReceive
from weight_sync.loading import Delivery, LoadResult, Named, Tally, WeightLoader
from weight_sync.snapshot import read_snapshot
from weight_sync.versions import Weights


@dataclass
class Incoming:
    """One update's tensors as received, and what a loader may do with their memory."""

    named: Named
    lock: threading.Lock | None = None
    """Held while the tensors are loaded: no receive writes into their buffers meanwhile."""
    on_kept: Callable[[], None] | None = None
    """Set when the tensors are views into receive buffers: call it once the loader kept them as its
    weights, and they are never received into again. None: transient tensors, to be copied."""

    @property
    def adoptable(self) -> bool:
        return self.on_kept is not None

    def holding(self) -> contextlib.AbstractContextManager:
        return self.lock if self.lock is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class Timeouts:
    transfer_s: float
    """Each broadcast of a transfer (the process group's timeout)."""
    go_s: float
    """Waiting for the sender's ``go`` (and the store): Prepare of every member plus the transfer."""


class SourceReceiver(abc.ABC):
    """The receiving end of one kind of ``WeightUpdatePlan.source``."""

    def start(self, plan: control_pb2.WeightUpdatePlan, *, device: torch.device | None, timeouts: Timeouts) -> None:  # noqa: B027
        """Begin receiving; must not block (the learner sends once every receiver answered Prepare).
        ``device``: where the loader's weights live (NCCL receives straight into that device)."""

    @abc.abstractmethod
    def take(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> Incoming:
        """Wait (at most ``timeout_s``) for the whole update; blocking."""

    def close(self) -> None:  # noqa: B027
        pass


class CollectiveReceiver(SourceReceiver):
    """``collective``: join the group named in the plan, receive every segment into reused buckets."""

    def __init__(self) -> None:
        self.receive = CollectiveReceive()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="weight-sync")
        self._receiving: dict[str, concurrent.futures.Future] = {}
        self.stream_deadline_s = 0.0

    def start(self, plan: control_pb2.WeightUpdatePlan, *, device: torch.device | None, timeouts: Timeouts) -> None:
        self._receiving.clear()
        self._use(plan, device, timeouts)
        self._receiving[plan.update_id] = self._pool.submit(self.receive.receive, plan, timeout_s=timeouts.transfer_s)

    def start_streaming(
        self,
        plan: control_pb2.WeightUpdatePlan,
        *,
        device: torch.device | None,
        timeouts: Timeouts,
        consume: Callable[[Iterator[tuple[str, torch.Tensor]]], object],
    ) -> None:
        """Receive bucket by bucket (:meth:`CollectiveReceive.stream`) and hand the tensors to ``consume``
        as they arrive, on the receive thread, during the transfer; :meth:`take_streamed` returns what
        ``consume`` returned. No whole-update receive buffers: at most two buckets (one dtype)."""
        self._receiving.clear()
        self._use(plan, device, timeouts)
        self.stream_deadline_s = timeouts.go_s + timeouts.transfer_s

        def run() -> object:
            named = self.receive.stream(plan, timeout_s=timeouts.transfer_s)
            try:
                result = consume(named)
                left = sum(1 for _ in named)  # the transfer completes only when every bucket was received
                if left:
                    raise RuntimeError(f"update {plan.update_id}: the loader left {left} tensors unread")
                return result
            finally:
                named.close()

        self._receiving[plan.update_id] = self._pool.submit(run)

    def take_streamed(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> object:
        future = self._receiving.pop(plan.update_id, None)
        if future is None:
            raise RuntimeError(f"update {plan.update_id} was never started")
        return future.result(timeout=timeout_s)

    def _use(self, plan: control_pb2.WeightUpdatePlan, device: torch.device | None, timeouts: Timeouts) -> None:
        # NCCL receives straight into the loader's GPU, else this thread's current one: resolved here, on the
        # caller's thread, as the receive thread's own current device is cuda:0. Gloo can only use CPU buffers.
        if plan.collective.backend == "nccl":
            if device is None or device.type != "cuda" or device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self.receive.device = device
        else:
            self.receive.device = torch.device("cpu")
        self.receive.go_timeout_s = timeouts.go_s

    def take(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> Incoming:
        future = self._receiving.pop(plan.update_id, None)
        if future is None:
            raise RuntimeError(f"update {plan.update_id} was never started")
        flats = future.result(timeout=timeout_s)
        members = Layout.from_plan(plan).bucket_members()
        named = [pair for flat, group in zip(flats, members, strict=True) for pair in unpack(flat, group)]
        return Incoming(named, lock=self.receive.lock, on_kept=lambda: self.receive.adopted(flats))

    def close(self) -> None:
        self._receiving.clear()
        self.receive.close()


class SnapshotReceiver(SourceReceiver):
    """``filesystem``: the learner wrote the snapshot; read it at commit."""

    def take(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> Incoming:
        return snapshot(Path(plan.filesystem.path))


SOURCES: dict[str, type[SourceReceiver]] = {"collective": CollectiveReceiver, "filesystem": SnapshotReceiver}
"""The receiving end of each ``WeightUpdatePlan.source`` kind."""


def snapshot(path: Path) -> Incoming:
    """A snapshot's tensors, read shard by shard as they are consumed (transient: copied on load)."""
    return Incoming(read_snapshot(path))


class Inbox:
    """The update in flight between Prepare and Commit, received by its source's :class:`SourceReceiver`.

    One update at a time: starting one forgets any other that was never taken.
    """

    def __init__(self) -> None:
        self._ends: dict[str, SourceReceiver] = {}
        self._pending: dict[str, tuple[control_pb2.WeightUpdatePlan, SourceReceiver]] = {}
        self._streamed: dict[str, tuple[control_pb2.WeightUpdatePlan, CollectiveReceiver]] = {}

    def end(self, kind: str) -> SourceReceiver:
        """The receiver of source ``kind`` (kept across updates: a collective reuses its group and buffers)."""
        end = self._ends.get(kind)
        if end is None:
            cls = SOURCES.get(kind)
            if cls is None:
                raise ValueError(f"WeightUpdatePlan.source {kind!r}: this receiver has no transport for it")
            end = self._ends[kind] = cls()
        return end

    def start(self, plan: control_pb2.WeightUpdatePlan, *, device: torch.device | None, timeouts: Timeouts) -> None:
        self._pending.clear()
        self._streamed.clear()
        end = self.end(plan.WhichOneof("source"))
        end.start(plan, device=device, timeouts=timeouts)
        self._pending[plan.update_id] = (plan, end)

    def take(self, update_id: str, *, timeout_s: float) -> tuple[control_pb2.WeightUpdatePlan, Incoming]:
        pending = self._pending.pop(update_id, None)
        if pending is None:
            raise RuntimeError(f"update {update_id!r} was never started here")
        plan, end = pending
        return plan, end.take(plan, timeout_s=timeout_s)

    def stream(
        self,
        plan: control_pb2.WeightUpdatePlan,
        *,
        device: torch.device | None,
        timeouts: Timeouts,
        consume: Callable[[Iterator[tuple[str, torch.Tensor]]], object],
    ) -> None:
        """Start a collective update that ``consume`` loads as it arrives (see
        :meth:`CollectiveReceiver.start_streaming`); :meth:`take_streamed` waits for it."""
        self._pending.clear()
        self._streamed.clear()
        end = self.end("collective")
        assert isinstance(end, CollectiveReceiver)
        end.start_streaming(plan, device=device, timeouts=timeouts, consume=consume)
        self._streamed[plan.update_id] = (plan, end)

    def streaming(self, update_id: str) -> bool:
        return update_id in self._streamed

    def take_streamed(self, update_id: str, *, timeout_s: float) -> object:
        pending = self._streamed.pop(update_id, None)
        if pending is None:
            raise RuntimeError(f"update {update_id!r} was never started here")
        plan, end = pending
        return end.take_streamed(plan, timeout_s=timeout_s)

    def cancel(self) -> None:
        """Forget the update in flight. A streamed one is loading into the model on its own thread: wait for
        that thread to end (it does within its transfer deadline: a called-off update's group is torn down)
        so that whoever resumes generation next never runs on weights still being written."""
        self._pending.clear()
        streamed, self._streamed = self._streamed, {}
        for plan, end in streamed.values():
            with contextlib.suppress(Exception):
                end.take_streamed(plan, timeout_s=end.stream_deadline_s)

    def close(self) -> None:
        self._pending.clear()
        self._streamed.clear()
        for end in self._ends.values():
            end.close()


class LocalDelivery(Delivery):
    """Receive in this process, then hand the tensors to ``loader.load_weights`` (``load_adapter`` under
    ``model.lora``). ``device``: where the loader's weights live, asked at each update (a model may move)."""

    def __init__(
        self, loader: WeightLoader, cfg: TetherConfig, *, device: Callable[[], torch.device | None] | None = None
    ) -> None:
        wcfg = cfg.weight_sync
        self.loader = loader
        self.sums = wcfg.verify_checksums
        self.lora_scale = cfg.model.lora.scale if cfg.model.lora is not None else None
        self.timeouts = Timeouts(
            transfer_s=wcfg.transfer_timeout_s, go_s=wcfg.prepare_timeout_s + wcfg.transfer_timeout_s
        )
        self.device = device
        self.inbox = Inbox()

    async def start(self, plan: control_pb2.WeightUpdatePlan) -> None:
        device = self.device() if self.device is not None else None
        self.inbox.start(plan, device=device, timeouts=self.timeouts)

    async def finish(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> Tally:
        _, incoming = await asyncio.to_thread(self.inbox.take, plan.update_id, timeout_s=timeout_s)
        return await self._load(incoming, version=plan.version)

    async def load_snapshot(self, path: Path, *, version: int) -> Tally:
        return await self._load(snapshot(path), version=version)

    async def cancel(self) -> None:
        self.inbox.cancel()

    async def load_pulled(self, weights: Weights, *, on_kept: Callable[[], None]) -> Tally:
        return await self._load(Incoming(weights.named_tensors().items(), on_kept=on_kept), version=weights.version)

    async def _load(self, incoming: Incoming, *, version: int) -> Tally:
        tally = Tally()
        named = tally.count(incoming.named, sums=self.sums)
        loop = asyncio.get_running_loop()

        def load_holding_the_buffers() -> None:
            # The receive lock is a thread lock, held for the whole load: a late receive (of an update
            # whose commit timed out) waits, and never writes into buffers being loaded. The load itself
            # is the loader's coroutine, on the loop; it finishes even if the caller gives up waiting.
            with incoming.holding():
                done = asyncio.run_coroutine_threadsafe(self._hand_over(named, version, incoming.adoptable), loop)
                result = done.result()
                if result.kept and incoming.on_kept is not None:
                    incoming.on_kept()

        await asyncio.to_thread(load_holding_the_buffers)
        return tally

    async def _hand_over(self, named: Named, version: int, adoptable: bool) -> LoadResult:
        if self.lora_scale is not None:
            return await self.loader.load_adapter(named, version=version, scale=self.lora_scale)
        return await self.loader.load_weights(named, version=version, adoptable=adoptable)
