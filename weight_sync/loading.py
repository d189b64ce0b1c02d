"""What weight sync asks of whatever it loads into: the contract between the transports and the engines.

Transports turn bytes into named tensors (``inbox.py``); an engine turns named tensors into the weights
it serves. The two meet here and nowhere else, so a new transport needs no engine code and a new engine
no transport code (transports + engines, not transports × engines). Weight sync never imports an engine
and never reads its attributes: it calls the methods of :class:`WeightLoader`, which the rollout
server's engines implement beside each engine (``rollout_server/engines/``).

Where the bytes are received is the engine's choice too (a :class:`Delivery`): in this process, handed to
``load_weights`` (:class:`weight_sync.inbox.LocalDelivery`, the default), or somewhere only the engine can
reach — vLLM receives inside its worker processes, which join the collective group themselves and run
weight sync's own receiving end there.

Importing this module imports nothing heavy (no torch), so an engine's base class can name these types.

The Control proto's ``InflightPolicy`` is part of this contract (what ``pause`` is told to do with the requests
the engine holds), so its one mapping to the names ``pause`` takes lives here too: the learner's sender, the
receiver and the rollout server's Pause RPC all use :func:`inflight_policy` / :func:`inflight_message`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

from tether.v1 import control_pb2

if TYPE_CHECKING:
    import torch

    from weight_sync.versions import Weights

Inflight = Literal["keep", "drain"]
"""What :meth:`WeightLoader.pause` does with the requests the engine holds: ``keep`` freezes them between two
steps (they go on with the new weights), ``drain`` lets them finish on the old weights first."""

_INFLIGHT: dict[int, Inflight] = {
    control_pb2.INFLIGHT_POLICY_KEEP: "keep",
    control_pb2.INFLIGHT_POLICY_DRAIN: "drain",
}


def inflight_policy(value: int, default: Inflight) -> Inflight:
    """A Control message's ``InflightPolicy`` as the name ``pause`` takes; ``INFLIGHT_POLICY_UNSPECIFIED``
    (or a value this build does not know): ``default``, the server's own ``weight_sync.inflight``."""
    return _INFLIGHT.get(value, default)


def inflight_message(policy: Inflight) -> control_pb2.InflightPolicy:
    """``weight_sync.inflight`` as the Control proto's ``InflightPolicy`` (what the learner asks of a server)."""
    for value, name in _INFLIGHT.items():
        if name == policy:
            return value  # type: ignore[return-value]
    raise ValueError(f"weight_sync.inflight {policy!r}: expected keep or drain")


PARTIAL_UPDATE = "weights partially loaded"


class PartialUpdate(RuntimeError):
    """A streamed load failed after some of its tensors were loaded: the model holds a mix of versions (the
    receiver replaces it from a snapshot). The message starts with :data:`PARTIAL_UPDATE` (it may cross a
    process boundary as text)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{PARTIAL_UPDATE}: {message}")


Named = Iterable[tuple[str, "torch.Tensor"]]
"""``(name, tensor)`` pairs: full (unsharded) tensors under the learner's (Hugging Face) names, in the
dtype they travelled in (``weight_sync.publish_dtype`` for a collective push or the store, the learner's
own for the filesystem transport). Consumed once, possibly lazily — a snapshot is read from disk shard by
shard as it is iterated, so a loader iterates it off the event loop."""


@dataclass(frozen=True)
class LoadResult:
    """What an engine answers after a load."""

    kept: bool = False
    """The engine's weights now *are* the tensors it was handed (it adopted views into the receive
    buffers instead of copying them): the transport must never write into that memory again. Only
    meaningful when the load was offered ``adoptable=True``."""


@dataclass
class Tally:
    """What one load took in: bytes, and each tensor's float64 sum when asked (the learner compares them
    with its own to count a server as reached)."""

    bytes: int = 0
    checksums: dict[str, float] = field(default_factory=dict)

    def count(self, named: Named, *, sums: bool) -> Iterator[tuple[str, torch.Tensor]]:
        """``named`` unchanged, counted as the loader consumes it (so a lazy snapshot stays lazy)."""
        from weight_sync.buckets import checksum

        for name, tensor in named:
            self.bytes += tensor.numel() * tensor.element_size()
            if sums:
                self.checksums[name] = checksum(tensor)
            yield name, tensor


class WeightLoader(Protocol):
    """The surface of an engine weight sync uses: pause and resume around an update, the version it
    serves, and the one method that loads named tensors (plus its LoRA variant).

    ``rollout_server.engines.Engine`` satisfies it; so does the test receiver's ``ModelEngine``
    (``tests/weight_receiver.py``).
    """

    policy_version: int
    """The version of the weights being served; the receiver sets it once a load returned."""

    async def pause(self, inflight: Inflight) -> None:
        """Stop admitting work; return once no forward pass runs (the update's safe point)."""

    async def resume(self) -> None: ...

    async def load_weights(self, named: Named, *, version: int, adoptable: bool = False) -> LoadResult:
        """Make ``named`` the engine's weights (version ``version``), all or nothing where the engine can.

        Called while the engine is paused, and the engine loads at its own safe point (between two
        generation steps). ``adoptable``: the tensors are views into receive buffers that this process
        sets aside once the engine says it kept them (``LoadResult(kept=True)``), so the engine may use
        them as its weights without a copy; otherwise they are transient (read from a snapshot) and must
        be copied. A name or shape the engine does not have is an error that says so.
        """

    async def load_adapter(self, named: Named, *, version: int, scale: float) -> LoadResult:
        """A LoRA update: ``named`` holds adapter tensors only, named as peft saves them; the engine sets
        each adapted weight to ``W0 + scale * B @ A`` from the base weights it keeps (``weight_sync.lora``
        has the helpers). Chosen by the run's ``model.lora``, which the learner and every server share."""


class Delivery(abc.ABC):
    """How one update reaches the weights an engine serves: start receiving at Prepare, load at Commit.

    The receiver's handshake (pause, deadlines, fallback to the snapshot, version, resume) is the same for
    every engine; only these four steps differ, and only in *where* they run.
    """

    @abc.abstractmethod
    async def start(self, plan: control_pb2.WeightUpdatePlan) -> None:
        """Begin receiving (a collective: join and receive in the background); must not block — the
        learner sends only after every receiver answered Prepare."""

    @abc.abstractmethod
    async def finish(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> Tally:
        """Wait for the transfer (at most ``timeout_s``) and load it as version ``plan.version``."""

    @abc.abstractmethod
    async def load_snapshot(self, path: Path, *, version: int) -> Tally:
        """Load the filesystem snapshot in ``path`` (catch-up, and the fallback of a failed transfer)."""

    async def cancel(self) -> None:  # noqa: B027 - a background receive ends by itself (aborted group)
        pass

    async def load_pulled(self, weights: Weights, *, on_kept: Callable[[], None]) -> Tally:
        """Load a version the server pulled from the store (``weight_sync.puller``) as ``weights.version``:
        its tensors are views into a buffer the puller keeps; ``on_kept`` is called if the engine kept them
        as its weights, so the puller never decodes into that buffer while they are served."""
        raise NotImplementedError(f"{type(self).__name__} cannot load a pulled version (transport: store)")
