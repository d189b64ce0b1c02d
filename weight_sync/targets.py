"""Where received weights land: a live ``torch.nn.Module`` in this process, or vLLM's workers.

Every target implements one receiver interface (:class:`Target`); :func:`make_target` picks the class
by the configured ``rollout.engine.type`` through :data:`TARGETS` — never by what attributes the engine
object happens to have (an SGLang engine also has an ``.llm``, and must not receive vLLM's worker RPCs).
A new engine adds its target class and one line to :data:`TARGETS`.

The receiver's handshake logic is the same for every engine; only "start receiving", "finish and load"
and "load a snapshot" differ. For the transformers engine the weights go straight into the module's
parameters (``copy_`` in place, so tied embeddings — one Parameter under two names — stay tied and
nothing holding a reference to a parameter goes stale). For vLLM the receiving happens inside vLLM's
worker processes (``weight_sync.vllm_worker.WeightSyncWorker``), which join the collective group
themselves; this side only forwards the plan as protobuf bytes over ``collective_rpc``.

With ``model.lora`` an update holds adapter tensors only and both targets merge them into the base
weights (:mod:`weight_sync.lora`).

Received buckets are loaded at commit, not as they arrive, so a transfer that fails half-way never
leaves a model with a mix of two versions (the price: one model's worth of receive buffers).
"""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
from collections.abc import Iterable
from pathlib import Path

import torch

from tether.config import TetherConfig
from tether.v1 import control_pb2
from weight_sync.adopt import adopt_into_module, matching, module_tensors
from weight_sync.buckets import Layout, checksum, unpack
from weight_sync.collective import CollectiveReceive
from weight_sync.lora import AdapterApplier
from weight_sync.snapshot import read_snapshot

LoadResult = tuple[int, dict[str, float]]  # bytes loaded, checksum per tensor (empty unless asked)


class Target(abc.ABC):
    @abc.abstractmethod
    async def start(self, plan: control_pb2.WeightUpdatePlan) -> None:
        """Begin receiving (collective: join and receive in the background); must not block."""

    @abc.abstractmethod
    async def finish(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> LoadResult:
        """Wait for the transfer (at most ``timeout_s``) and load it into the engine."""

    @abc.abstractmethod
    async def load_snapshot(self, path: Path) -> LoadResult: ...

    async def cancel(self) -> None:  # noqa: B027 - a background receive ends by itself (aborted group)
        pass


@torch.no_grad()
def load_into_module(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]], *, sums: bool) -> LoadResult:
    """Copy each ``(name, tensor)`` into the parameter or buffer of that name, in place."""
    tensors, nbytes, checksums = module_tensors(model), 0, {}
    for name, tensor in named:
        target = matching(tensors, name, tensor)
        target.copy_(tensor)
        nbytes += tensor.numel() * tensor.element_size()
        if sums:
            checksums[name] = checksum(target)
    return nbytes, checksums


class ModuleTarget(Target):
    """The transformers engine: ``engine.model`` in this process."""

    def __init__(self, engine, cfg: TetherConfig) -> None:
        self.engine = engine
        wcfg = cfg.weight_sync
        self.sums = wcfg.verify_checksums
        self.adapter = AdapterApplier(cfg.model.lora.scale) if cfg.model.lora is not None else None
        self.transfer_timeout_s = wcfg.transfer_timeout_s
        self.collective = CollectiveReceive(go_timeout_s=wcfg.prepare_timeout_s + wcfg.transfer_timeout_s)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="weight-sync")
        self._receiving: dict[str, concurrent.futures.Future] = {}

    def _model_device(self) -> torch.device:
        first = next(self.engine.model.parameters(), None)
        return first.device if first is not None else torch.device("cpu")

    async def start(self, plan: control_pb2.WeightUpdatePlan) -> None:
        self._receiving.clear()
        if plan.HasField("collective"):
            # NCCL receives straight into GPU memory; gloo can only use CPU buffers.
            nccl = plan.collective.backend == "nccl"
            self.collective.device = self._model_device() if nccl else torch.device("cpu")
            self._receiving[plan.update_id] = self._pool.submit(
                self.collective.receive, plan, timeout_s=self.transfer_timeout_s
            )

    async def finish(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> LoadResult:
        if plan.HasField("filesystem"):
            return await self.load_snapshot(Path(plan.filesystem.path))
        future = self._receiving.pop(plan.update_id, None)
        if future is None:
            raise RuntimeError(f"update {plan.update_id} was never started")
        flats = await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        members = Layout.from_plan(plan).bucket_members()
        named = [pair for flat, group in zip(flats, members, strict=True) for pair in unpack(flat, group)]
        return await asyncio.to_thread(self._load_received, flats, named)

    def _load_received(self, flats: list[torch.Tensor], named: list[tuple[str, torch.Tensor]]) -> LoadResult:
        # The parameters become views into the received buckets (no copy; weight_sync/adopt.py), which
        # the next update then never receives into. Holding the receive lock keeps a late receive (after
        # a commit that timed out) from touching them mid-load.
        with self.collective.lock:
            if self.adapter is not None:
                return self.adapter.load(self.engine.model, named, sums=self.sums)
            result, adopted = adopt_into_module(self.engine.model, named, sums=self.sums)
            if adopted:
                self.collective.adopted(flats)
            return result

    def _load(self, named: Iterable[tuple[str, torch.Tensor]]) -> LoadResult:
        if self.adapter is not None:
            return self.adapter.load(self.engine.model, named, sums=self.sums)
        return load_into_module(self.engine.model, named, sums=self.sums)

    async def load_snapshot(self, path: Path) -> LoadResult:
        return await asyncio.to_thread(self._load, read_snapshot(path))

    async def cancel(self) -> None:
        self._receiving.clear()


class VllmTarget(Target):
    """vLLM: forward each stage to the worker extension in every worker (``collective_rpc``)."""

    def __init__(self, engine, cfg: TetherConfig) -> None:
        self.engine = engine
        self.wcfg = cfg.weight_sync
        self.lora_scale = cfg.model.lora.scale if cfg.model.lora is not None else 0.0  # 0: full updates

    async def _rpc(self, method: str, *args) -> list:
        return await self.engine.llm.collective_rpc(method, args=args)

    @staticmethod
    def _merge(results: list) -> LoadResult:
        # Every worker loads the full update (vLLM shards inside load_weights); report the first.
        first = results[0] if results else {"bytes": 0, "checksums": {}}
        return int(first["bytes"]), dict(first["checksums"])

    async def start(self, plan: control_pb2.WeightUpdatePlan) -> None:
        go_timeout = self.wcfg.prepare_timeout_s + self.wcfg.transfer_timeout_s
        await self._rpc("tether_prepare", plan.SerializeToString(), self.wcfg.transfer_timeout_s, go_timeout)

    async def finish(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> LoadResult:
        sums = self.wcfg.verify_checksums
        result = self._merge(await self._rpc("tether_commit", plan.update_id, timeout_s, sums, self.lora_scale))
        await self._after_load()
        return result

    async def load_snapshot(self, path: Path) -> LoadResult:
        sums = self.wcfg.verify_checksums
        result = self._merge(await self._rpc("tether_load_snapshot", str(path), sums, self.lora_scale))
        await self._after_load()
        return result

    async def _after_load(self) -> None:
        # Cached prefixes hold keys/values computed by the old weights.
        await self.engine.llm.reset_prefix_cache()

    async def cancel(self) -> None:
        await self._rpc("tether_abort")


class TargetUnavailable(NotImplementedError):
    """This engine type cannot receive weight updates; the server answers weight-update RPCs UNIMPLEMENTED."""


TARGETS: dict[str, type[Target]] = {"transformers": ModuleTarget, "vllm": VllmTarget}
"""The receiver side of each ``rollout.engine.type`` that can follow the learner's weights."""

UNAVAILABLE: dict[str, str] = {
    "sglang": "weight sync into rollout.engine.type=sglang is not implemented: use rollout.engine.type=vllm "
    "(or transformers) for servers that must follow the learner's weights",
}
"""Engine types with no target, and what to do instead (the server still serves generation)."""


def make_target(engine, cfg: TetherConfig) -> Target:
    """The target of the configured engine type; an engine object of another type is a clear error."""
    kind = cfg.rollout.engine.type
    name = getattr(engine, "name", "") or kind
    if name != kind:
        raise TypeError(
            f"weight sync: rollout.engine.type is {kind!r} but the engine is {name!r} — build the engine and the "
            "receiver from the same config"
        )
    cls = TARGETS.get(kind)
    if cls is None:
        raise TargetUnavailable(UNAVAILABLE.get(kind, f"weight sync has no target for engine type {kind!r}"))
    return cls(engine, cfg)
