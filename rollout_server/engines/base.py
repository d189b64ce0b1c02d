"""The one interface every generation backend implements, and the plain data it speaks.

The gRPC servicer, the prompt worker and the episode store only ever see :class:`Engine`, so a backend
(transformers, vLLM, SGLang) is swapped by config alone. The contract is streaming-first: an engine
implements :meth:`Engine.stream`, which yields :class:`Chunk` objects (new tokens of one sample, each
with its behaviour log-prob and the policy version of the weights that produced it); the blocking
:meth:`Engine.generate` is built on top of it once, here, so every backend returns the same thing.
Plain dataclasses (not protobuf) keep engines free of gRPC and cheap to call in-process (the bench).

Each engine also owns how new weights get into it: :meth:`Engine.load_weights` (and ``load_adapter`` for
LoRA) takes named tensors and loads them at the engine's own safe point. Weight sync
(``weight_sync.loading.WeightLoader``) calls only these methods, never the engine's internals, and the
rollout server wires the two together (``control.load_receiver``).
"""

from __future__ import annotations

import abc
import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tether.v1 import trajectory_pb2

if TYPE_CHECKING:
    from tether.config import TetherConfig
    from weight_sync.loading import Delivery, LoadResult, Named

FINISH_STOP = trajectory_pb2.FINISH_REASON_STOP
FINISH_LENGTH = trajectory_pb2.FINISH_REASON_LENGTH
FINISH_ABORTED = trajectory_pb2.FINISH_REASON_ABORTED


class EngineError(RuntimeError):
    """The engine cannot serve a request (not started, shut down, or a backend failure)."""


class EngineRejected(ValueError):
    """The backend refused the request's parameters (the server answers INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class SamplingSpec:
    """Validated sampling settings of one request (the server fills defaults before building it)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    adapter: str = ""  # the named LoRA adapter the request generates with; "" = the model as loaded


@dataclass
class Chunk:
    """New tokens of sample ``index``; ``finish_reason`` is set (non-zero) on the sample's last chunk."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: int = 0


@dataclass
class Completion:
    """One finished completion."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: int = 0
    text: str = ""

    def add(self, chunk: Chunk) -> None:
        """Append one streamed chunk of this sample (its finish reason, once it has one)."""
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.versions += chunk.versions
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason


class Engine(abc.ABC):
    """A generation backend. ``policy_version`` is set by weight sync after a load."""

    name: str = ""
    logprob_source: Literal["raw", "processed"] = "raw"  # see tether.trajectory.LOGPROB_PROCESSED
    tokenizer: Any = None
    policy_version: int = 0
    max_model_len: int = 0

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model; after this, ``tokenizer`` and ``max_model_len`` are set."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Abort everything in flight and free the model."""

    @abc.abstractmethod
    def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        """Yield chunks of all ``spec.n`` samples until each has finished (interleaved by sample)."""

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Finish the request's unfinished samples with FINISH_REASON_ABORTED."""

    @abc.abstractmethod
    async def pause(self, inflight: Literal["keep", "drain"] = "keep") -> None:
        """Stop admitting new work. ``keep``: in-flight samples are frozen between steps and continue
        after :meth:`resume` (on whatever weights are loaded then); ``drain``: wait until they finish.
        Returns once the engine runs no forward pass, so weights can be replaced safely."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Admit work again after :meth:`pause`."""

    @property
    @abc.abstractmethod
    def paused(self) -> bool: ...

    async def wait_resumed(self) -> None:
        """Return once the engine admits work again (at once when it is not paused).

        The prompt workers wait here through a weight update instead of polling: a poll period is dead
        time on every update that lands while a worker looks (at the demo size a 50 ms poll stalled one
        step in eight). Engines with a resume event override this; the default polls finely.
        """
        while self.paused:
            await asyncio.sleep(0.002)

    @property
    def running_requests(self) -> int:
        return 0

    @property
    def queued_requests(self) -> int:
        return 0

    # --- weights ----------------------------------------------------------------------------------
    async def load_weights(self, named: Named, *, version: int, adoptable: bool = False) -> LoadResult:
        """Make ``named`` (full tensors under Hugging Face names) this engine's weights, version ``version``.

        Weight sync calls it while the engine is paused; the engine loads at its own safe point (between
        generation steps). ``adoptable``: the tensors are receive buffers the engine may keep as its
        weights without a copy (answer ``LoadResult(kept=True)`` if it did); otherwise copy them. The
        contract in full: ``weight_sync.loading.WeightLoader``. An engine that cannot load keeps this
        default: each update then fails on this server with the reason, which keeps its weights.
        """
        raise NotImplementedError(f"rollout.engine.type={self.name}: this engine cannot load weight updates")

    async def load_adapter(self, named: Named, *, version: int, scale: float) -> LoadResult:
        """A LoRA update (adapter tensors under peft's names): each adapted weight becomes ``W0 + scale * B @ A``."""
        raise NotImplementedError(f"rollout.engine.type={self.name}: this engine cannot load LoRA updates")

    def weight_delivery(self, cfg: TetherConfig) -> Delivery:
        """Where this engine receives an update: by default in this process, handed to :meth:`load_weights`.
        An engine whose weights live elsewhere (vLLM's workers) returns its own ``Delivery``."""
        from weight_sync.inbox import LocalDelivery

        return LocalDelivery(self, cfg)

    def step_counts(self) -> dict[str, int]:
        """Counts since start, for metrics and the bench: ``prefill`` / ``decode`` forward passes and
        ``prefill_rows`` / ``decode_rows`` (rows they ran; ``decode_rows / decode`` is the mean batch).
        Empty where the backend does not report them."""
        return {}

    async def generate(
        self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str | None = None
    ) -> list[Completion]:
        """All ``spec.n`` samples of one prompt, finished; the text is decoded without special tokens."""
        samples = [Completion() for _ in range(spec.n)]
        rid = request_id or uuid.uuid4().hex
        agen = self._stream_whole(prompt_ids, spec, request_id=rid)
        try:
            async for chunk in agen:
                samples[chunk.index].add(chunk)
        except asyncio.CancelledError:
            await self.abort(rid)
            raise
        finally:
            await agen.aclose()
        for s in samples:
            s.text = self.decode(s.token_ids)
        return samples

    def _stream_whole(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        """The chunks :meth:`generate` collects; an engine may hand them over in fewer, larger pieces
        (nobody watches them arrive), which saves a consumer wake-up per token."""
        return self.stream(prompt_ids, spec, request_id=request_id)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True) if token_ids else ""


class ResumeEvent:
    """The paused state of an engine that keeps it itself (vLLM, SGLang, a fleet's adapter views): one event,
    cleared by :meth:`_hold` when a pause begins and set by :meth:`_release` when it ends; the prompt workers
    wait on it (:meth:`wait_resumed`) instead of polling. Mixed in before :class:`Engine`."""

    def __init__(self) -> None:
        self._resumed = asyncio.Event()
        self._resumed.set()

    def _hold(self) -> None:
        self._resumed.clear()

    def _release(self) -> None:
        self._resumed.set()

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def wait_resumed(self) -> None:
        await self._resumed.wait()
