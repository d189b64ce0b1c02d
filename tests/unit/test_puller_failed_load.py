"""A pulled version that fails to load half-way is never served under either version's tag (issue 44, item 8).

The store transport's puller (:meth:`weight_sync.puller.Puller._swap`) pauses the engine, loads the version,
and resumes. vLLM's worker load copies tensor by tensor, so a failure there leaves the engine with some
tensors of the new version and the rest of the old. The engine here is a stand-in that copies into a real
module and fails after ``fail_after`` tensors, as such a load does; the loader records its pauses. The
checks fail on the puller that resumed in ``finally`` (serving the mixed weights under the old version).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from weight_sync.puller import Puller
from weight_sync.versions import Weights, flatten


class Engine:
    """The loader (pause/resume, policy_version) and its delivery (a tensor-by-tensor copy that can fail)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        self.policy_version = 0
        self.paused = False
        self.pauses = 0
        self.fail_after: int | None = None
        self.fail_version: int | None = None  # None: every version

    async def pause(self, inflight: str) -> None:
        assert not self.paused, "paused twice"
        self.paused, self.pauses = True, self.pauses + 1

    async def resume(self) -> None:
        self.paused = False

    async def load_pulled(self, weights: Weights, *, on_kept) -> None:  # type: ignore[no-untyped-def]
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for k, (name, tensor) in enumerate(weights.named_tensors().items()):
                failing = self.fail_version is None or weights.version == self.fail_version
                if self.fail_after is not None and k == self.fail_after and failing:
                    raise RuntimeError("worker load failed")
                params[name].copy_(tensor)

    def state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def _version(engine: Engine, version: int) -> Weights:
    return flatten({n: torch.full_like(p, float(version)) for n, p in engine.model.named_parameters()},
                   version=version, dtype="float32")  # fmt: skip


def _puller(engine: Engine, held: Weights | None) -> Puller:
    puller = object.__new__(Puller)  # no chunk service or Redis: only the swap is under test
    puller.loader, puller.delivery, puller.inflight = engine, engine, "keep"  # type: ignore[assignment]
    puller.held, puller.spare, puller.mixed = held, None, False
    puller.stats = {"load_failures": 0}
    return puller


def test_a_failed_load_brings_back_the_version_held() -> None:
    engine = Engine()
    v1 = _version(engine, 1)
    puller = _puller(engine, None)
    asyncio.run(puller._swap(v1, None))
    assert engine.policy_version == 1 and not engine.paused
    engine.fail_after, engine.fail_version = 2, 2  # v2's first weight and bias load, its second layer's do not
    with pytest.raises(RuntimeError, match="worker load failed"):
        asyncio.run(puller._swap(_version(engine, 2), None))
    assert all(bool((t == 1.0).all()) for t in engine.state().values())  # all of v1 again, nothing of v2
    assert engine.policy_version == 1 and not engine.paused and puller.held is v1
    assert puller.stats["load_failures"] == 1 and not puller.mixed
    engine.fail_after = None
    asyncio.run(puller._swap(_version(engine, 3), None))
    assert all(bool((t == 3.0).all()) for t in engine.state().values()) and engine.policy_version == 3


def test_with_nothing_whole_to_restore_the_engine_stays_paused_until_a_load_succeeds() -> None:
    """The first pull (the weights came from the model folder, no version is held) fails half-way: the engine
    does not resume on mixed weights; the next pull that loads whole resumes it, once."""
    engine = Engine()
    puller = _puller(engine, None)
    engine.fail_after = 2
    with pytest.raises(RuntimeError):
        asyncio.run(puller._swap(_version(engine, 1), None))
    assert engine.paused and puller.mixed and engine.policy_version == 0
    engine.fail_after = None
    asyncio.run(puller._swap(_version(engine, 2), None))  # no second pause while still paused
    assert not engine.paused and not puller.mixed and engine.pauses == 1 and engine.policy_version == 2
    assert all(bool((t == 2.0).all()) for t in engine.state().values())


def test_when_the_held_version_does_not_load_back_either_the_engine_stays_paused() -> None:
    engine = Engine()
    v1 = _version(engine, 1)
    puller = _puller(engine, None)
    asyncio.run(puller._swap(v1, None))
    engine.fail_after = 2  # every load fails half-way now, the restore of v1 too
    with pytest.raises(RuntimeError):
        asyncio.run(puller._swap(_version(engine, 2), None))
    assert engine.paused and puller.mixed and engine.policy_version == 1
