"""Two LoRA runs' views of one shared transformers engine (``rollout_server/engines/adapter_view.py``): each
view's requests generate with its own run's adapter once it has one (tagged with that adapter's version),
the base before; pausing one run does not stop the other; a full-weight update is refused; the engine
starts with the first view and shuts down with the last."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rollout_server.engines import SamplingSpec
from rollout_server.engines.adapter_view import AdapterView, SharedBase
from rollout_server.engines.base import EngineError
from tests.helpers import merged_lora_model
from tests.unit.test_multi_lora import SCALES, _adapters, _engine, _logprobs

PROMPT = [5, 6, 7, 8]


async def _one(view: AdapterView, **spec) -> tuple[list[int], list[float], list[int]]:  # type: ignore[no-untyped-def]
    (s,) = await view.generate(PROMPT, SamplingSpec(n=1, max_tokens=6, temperature=0.0, **spec))
    return s.token_ids, s.logprobs, s.versions


async def test_each_view_generates_with_its_runs_adapter_on_one_engine(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    base = SharedBase(engine)
    views = {run: AdapterView(base, run) for run in ("a", "b")}
    for view in views.values():
        await view.start()
    assert base.users == 2 and engine.model is not None
    try:
        adapters = _adapters(engine.model)
        before = await _one(views["a"])  # no update yet: the base (what a fresh adapter, B = 0, computes)
        await views["a"].load_adapter(adapters["a"], version=3, scale=SCALES["a"])
        tokens, logprobs, versions = await _one(views["a"])
        assert set(versions) == {3} and logprobs != before[1]
        want = _logprobs(merged_lora_model(tiny_model_dir, adapters["a"], SCALES["a"]), PROMPT, tokens)
        torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-4, rtol=0)
        assert await _one(views["b"]) == before  # run b: still the base, whatever run a loaded

        await views["a"].pause("drain")  # run a's update under way: run b goes on
        assert views["a"].paused and not views["b"].paused
        assert await asyncio.wait_for(_one(views["b"]), 30) == before
        await views["a"].resume()

        with pytest.raises(EngineError, match="takes LoRA adapter updates only"):
            await views["b"].load_weights([], version=1)
    finally:
        for view in views.values():
            await view.shutdown()
    assert base.users == 0 and engine.adapters == []
