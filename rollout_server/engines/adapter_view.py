"""LoRA runs of one base model sharing one engine on a fleet (``tether rollout --runs``; issue 36 item 2).

A fleet serving several runs that fine-tune LoRA adapters of the same base loads that base once
(:class:`SharedBase`) and gives each run an :class:`AdapterView`: to the run's slot the view is its engine.
Its requests generate with the run's named adapter (``SamplingSpec.adapter``; the transformers engine
applies each row's adapter in the one batch, ``rollout_server/engines/multi_lora.py``; vLLM serves each
version of it as a ``LoRARequest``, ``rollout_server/engines/vllm_adapters.py``), so the runs' rows batch
together on the shared weights; its LoRA updates replace that adapter only, without pausing the other
runs (transformers: at the next step, for running rows too; vLLM: for the requests that start after it);
its policy version is the run's. Before a run's first update its rows
generate with the base itself, which is what a freshly initialised adapter (``B = 0``) computes.

Pausing a view (a weight update of its run) stops that run's new work only; with ``inflight: drain`` it
waits for that run's own requests. A full-weight update is refused: a run on a shared base sends adapters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from rollout_server.engines.base import Chunk, Engine, EngineError, ResumeEvent, SamplingSpec

if TYPE_CHECKING:
    from tether.config import TetherConfig
    from weight_sync.loading import Delivery, LoadResult, Named


class SharedBase:
    """One engine and the views using it: started by the first view to start, shut down with the last."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.users = 0
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            if self.users == 0:
                await self.engine.start()
            self.users += 1

    async def release(self) -> None:
        async with self._lock:
            self.users -= 1
            if self.users == 0:
                await self.engine.shutdown()


class AdapterView(ResumeEvent, Engine):
    """One run's engine on a :class:`SharedBase`: its requests carry the run's adapter (see the module)."""

    def __init__(self, base: SharedBase, adapter: str) -> None:
        self.base, self.adapter = base, adapter
        self.policy_version = 0
        self._loaded = False  # the run's adapter is on the engine (after its first update)
        ResumeEvent.__init__(self)
        self._running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.base.engine.name

    @property
    def tokenizer(self) -> Any:  # type: ignore[override]
        return self.base.engine.tokenizer

    @property
    def max_model_len(self) -> int:  # type: ignore[override]
        return self.base.engine.max_model_len

    @property
    def logprob_source(self) -> Literal["raw", "processed"]:  # type: ignore[override]
        return self.base.engine.logprob_source

    async def start(self) -> None:
        await self.base.acquire()

    async def shutdown(self) -> None:
        try:
            if self._loaded:
                with contextlib.suppress(EngineError):
                    await self.base.engine.remove_adapter(self.adapter)
        finally:
            await self.base.release()

    def _spec(self, spec: SamplingSpec) -> SamplingSpec:
        return dataclasses.replace(spec, adapter=self.adapter) if self._loaded else spec

    def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        return self._counted(self.base.engine.stream(prompt_ids, self._spec(spec), request_id=request_id))

    def _stream_whole(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        return self._counted(self.base.engine._stream_whole(prompt_ids, self._spec(spec), request_id=request_id))

    async def _counted(self, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        """The run's own requests in flight (what ``pause("drain")`` waits for)."""
        self._running += 1
        self._idle.clear()
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            with contextlib.suppress(Exception):
                await chunks.aclose()  # type: ignore[attr-defined]
            self._running -= 1
            if self._running == 0:
                self._idle.set()

    async def abort(self, request_id: str) -> None:
        await self.base.engine.abort(request_id)

    async def pause(self, inflight: Literal["keep", "drain"] = "keep") -> None:
        """This run takes no new work; ``drain``: its requests in flight finish first. The other runs go on:
        an adapter update lands between two of the engine's steps (the engine's own safe point)."""
        self._hold()
        if inflight == "drain":
            await self._idle.wait()

    async def resume(self) -> None:
        self._release()

    @property
    def running_requests(self) -> int:
        return self._running

    @property
    def queued_requests(self) -> int:
        return self.base.engine.queued_requests

    async def load_weights(self, named: Named, *, version: int, adoptable: bool = False) -> LoadResult:
        raise EngineError(
            f"run {self.adapter!r} shares its base model on this fleet: it takes LoRA adapter updates only "
            "(a full-weight update would change every run's base)"
        )

    async def load_adapter(self, named: Named, *, version: int, scale: float) -> LoadResult:
        result = await self.base.engine.load_adapter(named, version=version, scale=scale, name=self.adapter)
        self._loaded = True
        return result

    def weight_delivery(self, cfg: TetherConfig) -> Delivery:
        from weight_sync.inbox import LocalDelivery

        return LocalDelivery(self, cfg, device=lambda: self.base.engine.device)

    def step_counts(self) -> dict[str, int]:
        return self.base.engine.step_counts()
