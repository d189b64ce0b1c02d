"""The transformers engine in-process: log-probs vs a forward pass, batching, pause/resume, stop, abort."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path

import pytest
import torch

from rollout_server.engines import SamplingSpec, build_engine
from rollout_server.engines.base import FINISH_ABORTED, FINISH_LENGTH, FINISH_STOP
from tether.config import load_config


@pytest.fixture
async def engine(tiny_model_dir: Path):
    e = build_engine(load_config(None, ["--model.path", str(tiny_model_dir), "--rollout.engine.batch_wait_ms", "20"]))
    await e.start()
    yield e
    await e.shutdown()


def forward_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Log-prob of each completion token under one unpadded forward pass at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


async def test_logprobs_match_forward_pass_across_a_padded_batch(engine) -> None:  # at temperature 1
    prompts = [engine.tokenizer("digits:")["input_ids"], engine.tokenizer("a much longer prompt here")["input_ids"]]
    outs = await asyncio.gather(*(engine.generate(p, SamplingSpec(n=2, max_tokens=12, seed=1)) for p in prompts))
    for prompt, samples in zip(prompts, outs, strict=True):
        assert len(samples) == 2
        for s in samples:
            assert len(s.token_ids) == len(s.logprobs) == len(s.versions) > 0
            assert s.finish_reason in (FINISH_STOP, FINISH_LENGTH)
            ref = forward_logprobs(engine.model, prompt, s.token_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=1e-4)


async def test_importance_weight_is_one_at_temperature_0_7(engine) -> None:
    """Version lag 0, T = 0.7: the learner's log-probs (its own path, temperature from the trajectory) equal
    the behaviour log-probs, so exp(learner - behaviour) = 1; the raw T = 1 log-probs would not."""
    from tests.helpers import learner_logprobs

    prompt = engine.tokenizer("digits:")["input_ids"]
    samples = await engine.generate(prompt, SamplingSpec(n=4, max_tokens=16, temperature=0.7, seed=3))
    assert engine.logprob_source == "processed"
    comps, behaviour = [s.token_ids for s in samples], [s.logprobs for s in samples]
    learner = learner_logprobs(engine.model, prompt, comps, behaviour, temperature=0.7)
    for s, got in zip(samples, learner, strict=True):
        weight = torch.exp(got - torch.tensor(s.logprobs))
        torch.testing.assert_close(weight, torch.ones_like(weight), atol=1e-4, rtol=0)
        # the reference: one plain forward pass, logits / 0.7
        with torch.no_grad():
            logits = engine.model(torch.tensor([prompt + s.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=1e-4)
    # The old convention (raw T = 1 log-probs) is measurably another distribution here.
    raw = [forward_logprobs(engine.model, prompt, c) for c in comps]
    assert max(float((r - torch.tensor(b)).abs().max()) for r, b in zip(raw, behaviour, strict=True)) > 0.05


async def test_greedy_logprobs_are_of_temperature_1(engine) -> None:
    from tests.helpers import learner_logprobs

    prompt = engine.tokenizer("greedy")["input_ids"]
    (s,) = await engine.generate(prompt, SamplingSpec(n=1, max_tokens=8, temperature=0.0))
    torch.testing.assert_close(torch.tensor(s.logprobs), forward_logprobs(engine.model, prompt, s.token_ids),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    (got,) = learner_logprobs(engine.model, prompt, [s.token_ids], [s.logprobs], temperature=0.0)
    torch.testing.assert_close(got, torch.tensor(s.logprobs), atol=1e-4, rtol=1e-4)


async def test_requests_close_together_share_a_batch(engine) -> None:
    ids = engine.tokenizer("x")["input_ids"]
    seen: list[int] = []
    original = engine._prefill

    async def spy(batch):
        seen.append(len(batch))
        return await original(batch)

    engine._prefill = spy
    await asyncio.gather(*(engine.generate(ids, SamplingSpec(n=2, max_tokens=4)) for _ in range(4)))
    assert seen == [4]


async def test_step_counts_say_what_the_engine_ran(engine) -> None:
    """One batch of 4 requests x 2 rows: one prefill of 8 rows, then decode passes of at most 8 rows each,
    one per token after the first (the prefill samples it) for the longest row."""
    ids = engine.tokenizer("x")["input_ids"]
    before = engine.step_counts()
    outs = await asyncio.gather(*(engine.generate(ids, SamplingSpec(n=2, max_tokens=6)) for _ in range(4)))
    got = {k: v - before[k] for k, v in engine.step_counts().items()}
    longest = max(len(s.token_ids) for samples in outs for s in samples)
    tokens = sum(len(s.token_ids) for samples in outs for s in samples)
    assert got["prefill"] == 1 and got["prefill_rows"] == 8
    assert got["decode"] == longest - 1
    assert got["decode_rows"] == tokens - 8  # every token after each row's first came from a decode row


async def test_a_requests_samples_share_one_prefill_row(engine) -> None:
    """n samples of a prompt: the prefill forward runs the prompt once (a row per request, not per sample),
    and each sample still scores as a forward pass of its own (the copied cache rows are the prompt's)."""
    prompts = [engine.tokenizer(t)["input_ids"] for t in ("one", "a second, longer prompt", "three")]
    widths: list[int] = []
    hook = engine.model.register_forward_pre_hook(lambda _m, args, kw: widths.append(kw["input_ids"].shape[0]),
                                                  with_kwargs=True)  # fmt: skip
    try:
        outs = await asyncio.gather(*(engine.generate(p, SamplingSpec(n=4, max_tokens=8, seed=2)) for p in prompts))
    finally:
        hook.remove()
    assert widths[0] == 3 and max(widths[1:], default=0) <= 12  # prefill: 3 prompts; decode: up to 12 rows
    for prompt, samples in zip(prompts, outs, strict=True):
        assert len({tuple(s.token_ids) for s in samples}) > 1  # the copies sample on their own
        for s in samples:
            ref = forward_logprobs(engine.model, prompt, s.token_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=1e-4)


async def test_seed_reproduces_and_greedy_is_deterministic(engine) -> None:
    ids = engine.tokenizer("seed")["input_ids"]
    a = await engine.generate(ids, SamplingSpec(n=2, max_tokens=8, seed=5))
    b = await engine.generate(ids, SamplingSpec(n=2, max_tokens=8, seed=5))
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert a[0].token_ids != a[1].token_ids  # samples of one request differ
    g = await engine.generate(ids, SamplingSpec(n=2, max_tokens=8, temperature=0.0))
    assert g[0].token_ids == g[1].token_ids


async def test_pause_keep_freezes_and_tokens_carry_the_new_version(engine) -> None:
    ids = engine.tokenizer("v")["input_ids"]
    # Seed 0 runs this row to its 500-token limit (~0.3 s here; 60 unseeded tokens took 35 ms on a fast
    # VM, so the request could finish before the pause): pause while it is surely still running.
    task = asyncio.create_task(engine.generate(ids, SamplingSpec(n=1, max_tokens=500, seed=0)))
    while engine.running_requests == 0 or not engine._running_rows:
        await asyncio.sleep(0.005)
    await engine.pause("keep")
    assert engine.paused and not task.done()
    engine.policy_version = 1  # what weight sync does after a load
    await asyncio.sleep(0.1)
    assert not task.done()
    await engine.resume()
    (s,) = await task
    assert s.versions[0] == 0 and s.versions[-1] == 1 and sorted(s.versions) == s.versions


async def test_a_paused_engine_wakes_its_waiters_on_resume(engine) -> None:
    """Prompt workers wait through a weight update on ``wait_resumed()``, not on a timer: it returns in
    the loop turns right after ``resume`` (a 50 ms poll here stalled one demo step in eight by ~45 ms),
    and at once when the engine is not paused."""
    await asyncio.wait_for(engine.wait_resumed(), timeout=5)
    await engine.pause("keep")
    waiter = asyncio.create_task(engine.wait_resumed())
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiter.done()
    await engine.resume()
    for _ in range(3):  # loop turns only: no timer can have fired
        await asyncio.sleep(0)
    assert waiter.done()


async def test_the_prompt_worker_waits_for_resume_instead_of_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker loop of a paused server awaits the engine's resume; it never sleeps a poll period."""
    from types import SimpleNamespace

    from rollout_server import worker as worker_module

    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def recorded(delay: float, *args):  # type: ignore[no-untyped-def]
        sleeps.append(delay)
        return await real_sleep(0)

    monkeypatch.setattr(worker_module.asyncio, "sleep", recorded)
    state = SimpleNamespace(draining=False)

    class Paused:
        paused = True
        waits = 0

        async def wait_resumed(self) -> None:
            self.waits += 1
            state.draining = self.waits == 3  # the third wait ends the loop

    state.engine = Paused()
    w = worker_module.PromptWorker.__new__(worker_module.PromptWorker)
    w.state = state
    await asyncio.wait_for(w._loop(0), timeout=5)
    assert state.engine.waits == 3 and sleeps == []


async def test_keep_tags_each_token_with_the_weights_that_produced_it(engine) -> None:
    """New weights with a zero (tied) output embedding give exactly uniform logits, so every token tagged
    with the new version must have log-prob -log V; a token sampled from logits of the old weights but
    tagged new would not."""
    forward, in_forward = engine._forward_sync, threading.Event()

    def slow_forward(state):  # the real forward, made slow so the pause lands inside one
        in_forward.set()
        time.sleep(0.05)
        return forward(state)

    engine._forward_sync = slow_forward
    ids = engine.tokenizer("w")["input_ids"]
    task = asyncio.create_task(engine.generate(ids, SamplingSpec(n=1, max_tokens=40)))
    for _ in range(3):  # past the prefill, into a decode step
        in_forward.clear()
        await asyncio.to_thread(in_forward.wait)
    await engine.pause("keep")
    with torch.no_grad():
        engine.model.get_output_embeddings().weight.zero_()
    engine.policy_version = 1
    await engine.resume()
    (s,) = await task
    uniform = -math.log(engine.model.config.vocab_size)
    assert 0 in s.versions and 1 in s.versions
    for version, logprob in zip(s.versions, s.logprobs, strict=True):
        if version == 1:
            assert logprob == pytest.approx(uniform, abs=1e-5)


async def test_pause_drain_waits_for_in_flight_and_holds_new_work(engine) -> None:
    ids = engine.tokenizer("d")["input_ids"]
    first = asyncio.create_task(engine.generate(ids, SamplingSpec(n=1, max_tokens=20)))
    await asyncio.sleep(0.1)
    await engine.pause("drain")
    assert first.done()
    held = asyncio.create_task(engine.generate(ids, SamplingSpec(n=1, max_tokens=3)))
    await asyncio.sleep(0.2)
    assert not held.done()
    await engine.resume()
    assert len((await held)[0].token_ids) == 3


async def test_stop_string_and_abort(engine) -> None:
    ids = engine.tokenizer("s")["input_ids"]
    (free,) = await engine.generate(ids, SamplingSpec(n=1, max_tokens=30, seed=3))
    stop = free.text[3:5]
    if stop and "\ufffd" not in stop:
        (cut,) = await engine.generate(ids, SamplingSpec(n=1, max_tokens=30, seed=3, stop=(stop,)))
        assert cut.finish_reason == FINISH_STOP and len(cut.token_ids) < len(free.token_ids)
    task = asyncio.create_task(engine.generate(ids, SamplingSpec(n=2, max_tokens=200), request_id="r-abort"))
    while not engine._running_rows:  # abort once it runs, well before 200 tokens
        await asyncio.sleep(0.001)
    await engine.abort("r-abort")
    samples = await task
    assert all(s.finish_reason == FINISH_ABORTED and len(s.token_ids) < 200 for s in samples)


async def test_a_request_joins_the_running_batch_and_leaves_it_when_done(engine) -> None:
    """A short request sent while a long one decodes is prefilled into the running batch and finishes first;
    the cache columns only it needed are cut when it leaves; every log-prob still matches a plain forward
    pass (the re-laid-out cache changes nothing a row sees)."""
    engine._eos.clear()  # rows run to max_tokens: the timing of who finishes first is then by construction
    prefills, widths = [], []
    prefill, forward = engine._prefill, engine._forward_sync

    async def spy_prefill(requests):
        prefills.append(sum(r.spec.n for r in requests))
        return await prefill(requests)

    def spy_forward(state):  # each decode step: the cache is never wider than the longest live row needs
        if state["cache"] is not None:
            widths.append((state["mask"].shape[1], max(len(r.req.prompt_ids) + len(r.generated) for r in engine._rows)))
        return forward(state)

    engine._prefill, engine._forward_sync = spy_prefill, spy_forward
    short_prompt = engine.tokenizer("x")["input_ids"]
    long_prompt = engine.tokenizer("a much longer prompt than the running one")["input_ids"]
    running = asyncio.create_task(engine.generate(short_prompt, SamplingSpec(n=2, max_tokens=80, seed=4)))
    while not engine._rows or len(engine._rows[0].generated) < 5:
        await asyncio.sleep(0.005)
    (joined,) = await engine.generate(long_prompt, SamplingSpec(n=1, max_tokens=6, seed=5))
    assert not running.done(), "the new request waited for the running batch to end"
    samples = await running
    assert prefills == [2, 1]
    assert len(widths) >= 79 and all(width <= longest for width, longest in widths)
    assert len(joined.token_ids) == 6 and all(len(s.token_ids) == 80 for s in samples)
    for prompt, s in [(long_prompt, joined), (short_prompt, samples[0]), (short_prompt, samples[1])]:
        ref = forward_logprobs(engine.model, prompt, s.token_ids)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=1e-4, rtol=1e-4)


async def test_newcomers_a_few_ms_apart_join_the_running_batch_in_one_prefill(tiny_model_dir: Path) -> None:
    """While a row runs, a newcomer with room left waits for others (up to batch_wait_ms) instead of being
    prefilled alone at the next step; once the waiting requests fill max_num_seqs they join at once."""
    e = build_engine(load_config(None, ["--model.path", str(tiny_model_dir), "--rollout.engine.max_num_seqs", "3",
                                        "--rollout.engine.batch_wait_ms", "0"]))  # fmt: skip
    await e.start()
    try:
        e._eos.clear()
        prefills: list[int] = []
        prefill = e._prefill

        async def spy(requests):
            prefills.append(len(requests))
            return await prefill(requests)

        e._prefill = spy
        ids = e.tokenizer("x")["input_ids"]
        running = asyncio.create_task(e.generate(ids, SamplingSpec(n=1, max_tokens=400)))
        while not e._rows:
            await asyncio.sleep(0.005)
        e.ecfg.batch_wait_ms = 60_000  # from here only a full batch lets newcomers in (the test never waits this)
        first = asyncio.create_task(e.generate(ids, SamplingSpec(n=1, max_tokens=3)))
        await asyncio.sleep(0.05)  # the running row decodes on; the first newcomer waits
        second = asyncio.create_task(e.generate(ids, SamplingSpec(n=1, max_tokens=3)))
        await asyncio.gather(first, second)
        assert prefills == [1, 2] and not running.done()
        await e.abort(next(iter(e._requests)))
        await running
    finally:
        await e.shutdown()


async def test_abort_of_one_request_leaves_the_others_running(engine) -> None:
    engine._eos.clear()
    ids = engine.tokenizer("abort one")["input_ids"]
    kept = asyncio.create_task(engine.generate(ids, SamplingSpec(n=1, max_tokens=150, seed=6)))
    gone = asyncio.create_task(engine.generate(ids, SamplingSpec(n=2, max_tokens=150), request_id="r-one"))
    while engine._running_rows < 3:
        await asyncio.sleep(0.001)
    await engine.abort("r-one")
    aborted = await gone
    assert all(s.finish_reason == FINISH_ABORTED and len(s.token_ids) < 150 for s in aborted)
    assert engine._running_rows == 1 and not kept.done()  # its rows left the batch; the other row goes on
    (s,) = await kept
    assert s.finish_reason == FINISH_LENGTH and len(s.token_ids) == 150
    torch.testing.assert_close(torch.tensor(s.logprobs), forward_logprobs(engine.model, ids, s.token_ids),
                               atol=1e-4, rtol=1e-4)  # fmt: skip


async def test_a_failing_forward_aborts_its_rows_and_the_engine_serves_on(engine) -> None:
    forward, calls = engine._forward_sync, []

    def failing(state):  # the real forward, failing once in a decode step
        calls.append(state["cache"] is None)
        if len(calls) == 4:
            raise RuntimeError("backend failure")
        return forward(state)

    engine._forward_sync = failing
    ids = engine.tokenizer("fail")["input_ids"]
    engine._eos.clear()
    (s,) = await engine.generate(ids, SamplingSpec(n=1, max_tokens=20))
    assert s.finish_reason == FINISH_ABORTED and len(s.token_ids) == 3  # what came before the failure is kept
    (t,) = await engine.generate(ids, SamplingSpec(n=1, max_tokens=5))
    assert t.finish_reason == FINISH_LENGTH and len(t.token_ids) == 5


async def test_a_failing_prefill_aborts_only_its_newcomers(engine) -> None:
    # A request whose own forward fails (a token id outside the vocabulary, which the server's checks would
    # have refused) joins a running batch: it ends aborted; the running request — on a fleet's shared base
    # maybe another run's — goes on to its last token, its log-probs unchanged.
    engine._eos.clear()
    prompt = engine.tokenizer("x")["input_ids"]
    running = asyncio.create_task(engine.generate(prompt, SamplingSpec(n=1, max_tokens=60, seed=2)))
    while not engine._rows or len(engine._rows[0].generated) < 3:
        await asyncio.sleep(0.005)
    (bad,) = await engine.generate([10**6], SamplingSpec(n=1, max_tokens=4))
    assert bad.finish_reason == FINISH_ABORTED and not bad.token_ids
    (s,) = await running
    assert s.finish_reason == FINISH_LENGTH and len(s.token_ids) == 60
    torch.testing.assert_close(torch.tensor(s.logprobs), forward_logprobs(engine.model, prompt, s.token_ids),
                               atol=1e-4, rtol=1e-4)  # fmt: skip


def test_a_sliding_window_no_row_outgrows_gets_a_joinable_cache() -> None:
    """Gemma 3-style layers (sliding + full): the model's own cache cannot be re-laid out, so rows could only
    start together; with rows never longer than the window the engine takes full layers, which can."""
    from transformers import Gemma3TextConfig

    from rollout_server.engines.kv_batch import _joinable, new_cache

    cfg = Gemma3TextConfig(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    assert not _joinable(new_cache(cfg, longest=65))  # a row may pass the window: the model's own cache
    assert _joinable(new_cache(cfg, longest=64))
    other = Gemma3TextConfig(num_hidden_layers=2, layer_types=["full_attention", "full_attention"], sliding_window=8)
    assert _joinable(new_cache(other, longest=10_000))
