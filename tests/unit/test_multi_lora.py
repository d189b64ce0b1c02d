"""Named LoRA adapters applied per row on the transformers engine: one batch mixes rows of two adapters
and of the base model, and each row's log-probs are those of a model with its adapter merged (the
engine's own merge path, and ``W0 + scale * B @ A`` computed here); with none loaded nothing changes.
Adapters replace, are removed and are refused by name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rollout_server.engines import SamplingSpec, build_engine
from rollout_server.engines.base import EngineError, EngineRejected
from tests.helpers import merged_lora_model
from tether.config import load_config

SCALES = {"a": 2.0, "b": 0.5}


def _engine(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    """On the CPU, in float32 (the comparisons are to 1e-4), whatever accelerator the host has."""
    args = [
        "--model.path",
        str(tiny_model_dir),
        "--rollout.engine.batch_wait_ms",
        "50",
        "--rollout.engine.device",
        "cpu",
    ]
    return build_engine(load_config(None, args))


def _adapter(model: torch.nn.Module, rank: int, modules: tuple[str, ...], seed: int) -> list[tuple[str, torch.Tensor]]:
    """Random lora_A/lora_B pairs under peft's saved names for every Linear whose name ends in ``modules``."""
    g = torch.Generator().manual_seed(seed)
    named = []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in modules:
            out, inp = m.weight.shape
            named.append((f"base_model.model.{name}.lora_A.weight", torch.randn(rank, inp, generator=g) * 0.3))
            named.append((f"base_model.model.{name}.lora_B.weight", torch.randn(out, rank, generator=g) * 0.3))
    assert named
    return named


def _adapters(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.Tensor]]]:
    return {
        "a": _adapter(model, 2, ("q_proj", "v_proj", "down_proj"), seed=1),
        "b": _adapter(model, 4, ("q_proj", "o_proj", "up_proj"), seed=2),
    }


def _logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


async def _mixed(engine, prompts: dict[str, list[int]], **spec):  # type: ignore[no-untyped-def]
    """One request per adapter name ("" = none), sent together; {name: samples}."""
    outs = await asyncio.gather(
        *(engine.generate(p, SamplingSpec(n=2, max_tokens=10, seed=7, adapter=k, **spec)) for k, p in prompts.items())
    )
    return dict(zip(prompts, outs, strict=True))


async def test_one_batch_mixes_adapters_and_each_row_matches_its_merged_model(tiny_model_dir: Path) -> None:
    # The references: for each adapter an engine with it merged by the engine's own merge path (name="";
    # its scale is fixed by its first update, hence one engine each), and the merge computed here.
    engine, merged = _engine(tiny_model_dir), {"a": _engine(tiny_model_dir), "b": _engine(tiny_model_dir)}
    for e in (engine, *merged.values()):
        await e.start()
    try:
        adapters = _adapters(engine.model)
        base_weights = {k: v.clone() for k, v in engine.model.state_dict().items()}
        for name, named in adapters.items():
            await engine.load_adapter(named, version=3 if name == "a" else 5, scale=SCALES[name], name=name)
        assert engine.adapters == ["a", "b"]
        named_rows: list[list[str]] = []  # spy on what each forward ran with
        rows = engine._named.rows
        engine._named.rows = lambda names: (named_rows.append(list(names)), rows(names))[1]  # type: ignore[method-assign]
        tok = engine.tokenizer
        prompts = {
            k: tok(text)["input_ids"] for k, text in (("a", "adapter a"), ("b", "the b prompt, longer"), ("", "x"))
        }
        before = engine.step_counts()
        outs = await _mixed(engine, prompts)
        counts = engine.step_counts()
        # One prefill for all 6 rows (each request's prompt once, its 2 samples copied after), and forwards whose
        # rows mix both adapters and the base model.
        assert counts["prefill"] - before["prefill"] == 1 and counts["prefill_rows"] - before["prefill_rows"] == 6
        assert named_rows[0] == ["a", "b", ""]
        assert named_rows[1] == ["a", "a", "b", "b", "", ""]
        assert sum({"a", "b", ""} <= set(r) for r in named_rows) >= 2  # the prefill and at least one decode step
        for name, samples in outs.items():
            # The rows with none: the base model, plain and the engine's own (its hooks add nothing outside a step).
            references = [merged_lora_model(tiny_model_dir, [], 0.0), engine.model]
            if name:
                here = merged_lora_model(tiny_model_dir, adapters[name], SCALES[name])
                await merged[name].load_adapter(adapters[name], version=0, scale=SCALES[name])
                for k, v in here.state_dict().items():
                    torch.testing.assert_close(merged[name].model.state_dict()[k], v, atol=1e-6, rtol=1e-6)
                references = [merged[name].model, here]
            for s in samples:
                assert len(s.token_ids) > 2
                assert set(s.versions) == {{"a": 3, "b": 5, "": 0}[name]}  # a named adapter's rows carry its version
                for ref in references:
                    want = _logprobs(ref, prompts[name], s.token_ids)
                    torch.testing.assert_close(torch.tensor(s.logprobs), want, atol=1e-4, rtol=1e-4)
                if name:  # the adapter changes the output: the base model disagrees
                    base = _logprobs(engine.model, prompts[name], s.token_ids)
                    assert float((base - torch.tensor(s.logprobs)).abs().max()) > 0.05
        # Greedy: the same tokens as the engine whose weights have "b" merged.
        greedy = await _mixed(engine, prompts, temperature=0.0)
        (want,) = await merged["b"].generate(prompts["b"], SamplingSpec(max_tokens=10, temperature=0.0))
        assert greedy["b"][0].token_ids == want.token_ids
        assert all(torch.equal(v, base_weights[k]) for k, v in engine.model.state_dict().items())  # never merged
    finally:
        for e in (engine, *merged.values()):
            await e.shutdown()


async def test_without_named_adapters_the_engine_is_unchanged(tiny_model_dir: Path) -> None:
    plain, used = _engine(tiny_model_dir), _engine(tiny_model_dir)
    await plain.start()
    await used.start()
    try:
        tok = plain.tokenizer
        prompts = {"": tok("same prompt")["input_ids"]}
        want = await _mixed(plain, prompts)
        assert _hooks(plain.model) == 0
        await used.load_adapter(_adapters(used.model)["a"], version=1, scale=2.0, name="a")
        assert _hooks(used.model) == 3 * 2  # q, v and down_proj of both layers
        loaded = await _mixed(used, prompts)  # loaded but not named by any request: bit-identical
        await used.remove_adapter("a")
        assert _hooks(used.model) == 0 and used.adapters == []
        removed = await _mixed(used, prompts)
        for got in (loaded, removed):
            for s, w in zip(got[""], want[""], strict=True):
                assert s.token_ids == w.token_ids and s.logprobs == w.logprobs and s.versions == w.versions
    finally:
        await plain.shutdown()
        await used.shutdown()


async def test_adapters_are_refused_replaced_and_removed_by_name(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    await engine.start()
    try:
        prompt = engine.tokenizer("replace me")["input_ids"]
        with pytest.raises(EngineRejected, match=r"adapter 'a' is not loaded on this engine \(loaded: \[\]\)"):
            await engine.generate(prompt, SamplingSpec(adapter="a"))
        adapters = _adapters(engine.model)
        for name, named in adapters.items():
            await engine.load_adapter(named, version=1, scale=SCALES[name], name=name)
        with pytest.raises(EngineRejected, match=r"adapter 'c' is not loaded .*\['a', 'b'\]"):
            await engine.generate(prompt, SamplingSpec(adapter="c"))
        greedy = {"temperature": 0.0}
        first = await _mixed(engine, {"a": prompt, "b": prompt}, **greedy)
        fresh = _adapter(engine.model, 2, ("q_proj", "v_proj", "down_proj"), seed=11)
        await engine.load_adapter(fresh, version=2, scale=2.0, name="a")
        second = await _mixed(engine, {"a": prompt, "b": prompt}, **greedy)
        assert second["a"][0].logprobs != first["a"][0].logprobs and second["a"][0].versions[0] == 2
        assert second["b"][0].token_ids == first["b"][0].token_ids and second["b"][0].logprobs == first["b"][0].logprobs
        want = _logprobs(merged_lora_model(tiny_model_dir, fresh, 2.0), prompt, second["a"][0].token_ids)
        torch.testing.assert_close(torch.tensor(second["a"][0].logprobs), want, atol=1e-4, rtol=1e-4)
        await engine.remove_adapter("a")
        with pytest.raises(EngineRejected, match=r"adapter 'a' is not loaded .*\['b'\]"):
            await engine.generate(prompt, SamplingSpec(adapter="a"))
        with pytest.raises(EngineError, match="no adapter 'a' is loaded"):
            await engine.remove_adapter("a")
        whole = [*adapters["b"], ("base_model.model.model.norm.weight", torch.ones(128))]
        with pytest.raises(ValueError, match="cannot be applied per request"):
            await engine.load_adapter(whole, version=1, scale=1.0, name="c")
        assert engine.adapters == ["b"]
    finally:
        await engine.shutdown()


async def test_a_replaced_adapter_reaches_running_rows_at_a_step_boundary(tiny_model_dir: Path) -> None:
    """No pause: the load lands between two steps; the row's tokens switch version once, never back."""
    engine = _engine(tiny_model_dir)
    await engine.start()
    try:
        adapters = _adapters(engine.model)
        await engine.load_adapter(adapters["a"], version=1, scale=2.0, name="a")
        prompt = engine.tokenizer("long run")["input_ids"]
        versions: list[int] = []
        stream = engine.stream(prompt, SamplingSpec(max_tokens=200, adapter="a", seed=1), request_id="r")
        async for chunk in stream:
            versions += chunk.versions
            if len(versions) >= 3 and 2 not in versions:
                fresh = _adapter(engine.model, 2, ("q_proj",), seed=5)
                await engine.load_adapter(fresh, version=2, scale=1.0, name="a")
        assert versions[0] == 1 and versions[-1] == 2 and versions == sorted(versions), versions
    finally:
        await engine.shutdown()
