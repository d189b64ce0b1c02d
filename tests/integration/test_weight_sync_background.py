"""Publication off the learner's critical path (``publish(..., background=True)``), over real gloo groups.

A receiver whose pause is held by a gate shows what the learner may and may not see: the publish call
returns while the update is still in flight, the model may change right away (the next optimizer step)
without the receivers getting any of that change, and the update lands — whole, exactly the weights at
publish time — once the gate opens. The synchronous call never returns before every receiver committed.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from tests.integration.test_weight_sync_gloo import Fleet, _cfg, fleet  # noqa: F401 - the fixture
from tests.weight_receiver import ModelEngine
from tether.commands.tiny_model import make_tiny_model
from weight_sync.sender import WeightSender

pytestmark = pytest.mark.timeout(120)


class GatedEngine(ModelEngine):
    """Pausing (the first stage of every update) waits for ``gate``: the test decides when the update runs."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.gate = threading.Event()

    async def pause(self, inflight: str) -> None:
        if not await asyncio.to_thread(self.gate.wait, 30):
            raise TimeoutError("the test never opened the gate")
        await super().pause(inflight)


def _gated(fleet: Fleet, model_dir: Path, cfg) -> tuple[str, GatedEngine]:  # noqa: F811
    address = fleet.add(model_dir, cfg)
    engine = fleet.engines[-1]
    gated = GatedEngine(engine.model)
    gated.policy_version = engine.policy_version
    fleet.receivers[-1].loader = gated  # pauses and versions go to the gate; loads to the same model
    return address, gated


def test_background_publish_returns_before_the_update_lands_and_sends_the_weights_of_its_call(
    tmp_path: Path,
    tiny_model_dir: Path,
    fleet: Fleet,  # noqa: F811
) -> None:
    cfg = _cfg(tmp_path)
    learner = ModelEngine.from_path(make_tiny_model(tmp_path / "learner", hidden=128, layers=2, heads=4, seed=1)).model
    address, engine = _gated(fleet, tiny_model_dir, cfg)
    sent = {name: p.detach().clone() for name, p in learner.named_parameters()}
    sender = WeightSender(cfg, model=learner, servers=[address])
    try:
        done: list[dict] = []
        assert sender.publish(1, background=True, on_done=done.append) == {}
        # Returned with the receiver still held before its pause: nothing of version 1 has landed.
        assert sender.in_flight == 1 and engine.policy_version == 0 and engine.pauses == 0 and done == []
        with pytest.raises(RuntimeError, match="still in flight"):
            sender.publish(2, background=True)  # one at a time: versions stay in order
        with torch.no_grad():  # the next optimizer step, while version 1 is on its way
            for p in learner.parameters():
                p.add_(1.0)
        engine.gate.set()
        metrics = sender.wait()
        assert metrics["weight_sync/reached"] == 1 and metrics["weight_sync/background"] == 1, sender.last_dropped
        assert done == [metrics]  # the learner's hook ran once the commit was over (it feeds prompts there)
        assert sender.in_flight is None and engine.policy_version == 1 and engine.paused is None
        for name, param in engine.model.named_parameters():
            torch.testing.assert_close(param, sent[name], rtol=0, atol=0)  # the weights at the call, not after

        # The synchronous call returns only once the receiver committed, with the weights of its call.
        metrics = sender.publish(2)
        assert metrics["weight_sync/reached"] == 1 and metrics["weight_sync/background"] == 0
        assert engine.policy_version == 2
        torch.testing.assert_close(engine.model.lm_head.weight, learner.lm_head.weight, rtol=0, atol=0)
    finally:
        engine.gate.set()
        sender.close()
