"""ShareGate: tokens in proportion to shares over time, idle runs yield theirs without hoarding credit,
capacity holds, and failed, cancelled and removed turns leak no slot.

The work is simulated and deterministic: each worker coroutine loops over turns that yield to the loop
a (seeded) few times and spend a fixed number of tokens; the tests count grants and tokens, never time.
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Awaitable, Callable

import pytest

from rollout_server.shares import RunRemoved, ShareGate

Log = list[tuple[str, int]]  # (run, tokens) of each finished turn, in the order they finished


def bounded(test: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    """Fail a test that hangs (a leaked slot, a lost grant) instead of hanging the suite."""

    @functools.wraps(test)
    async def run(*args: object, **kwargs: object) -> None:
        await asyncio.wait_for(test(*args, **kwargs), timeout=10)

    return run


async def _worker(gate: ShareGate, run: str, tokens: int, seed: int, log: Log, stop: Callable[[], bool]) -> None:
    rng = random.Random(seed)
    while not stop():
        async with gate.turn(run) as turn:
            for _ in range(rng.randint(1, 3)):  # interleave with the other workers
                await asyncio.sleep(0)
            turn.spend(tokens)
        log.append((run, tokens))


def _workers(gate: ShareGate, run: str, n: int, tokens: int, log: Log, stop: Callable[[], bool]) -> list[asyncio.Task]:
    return [
        asyncio.create_task(_worker(gate, run, tokens, 1000 * len(run) + sum(map(ord, run)) + i, log, stop))
        for i in range(n)
    ]


def _total(log: Log) -> int:
    return sum(tokens for _, tokens in log)


def _fraction(log: Log, run: str, window: int) -> float:
    """``run``'s part of the first ``window`` tokens of ``log``."""
    seen = mine = 0
    for name, tokens in log:
        if seen >= window:
            break
        seen += tokens
        mine += tokens if name == run else 0
    assert seen >= window, f"the log holds only {seen} tokens"
    return mine / seen


async def _hold(gate: ShareGate, run: str, release: asyncio.Event, tokens: int = 0) -> None:
    async with gate.turn(run) as turn:
        await release.wait()
        turn.spend(tokens)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize(("tokens_a", "tokens_b"), [(10, 10), (7, 13), (13, 7)])
@bounded
async def test_tokens_follow_shares_under_contention(tokens_a: int, tokens_b: int) -> None:
    gate = ShareGate(capacity=2)
    gate.add_run("a", 1.0)
    gate.add_run("b", 3.0)
    log: Log = []
    stop = lambda: _total(log) >= 8000  # noqa: E731
    await asyncio.gather(*_workers(gate, "a", 4, tokens_a, log, stop), *_workers(gate, "b", 4, tokens_b, log, stop))
    assert _fraction(log, "b", 8000) == pytest.approx(0.75, abs=0.05)
    # more groups to the run with the smaller ones: shares are of tokens, not of groups
    groups = {run: stats["groups"] for run, stats in gate.stats().items()}
    assert groups["b"] / groups["a"] == pytest.approx(3 * tokens_a / tokens_b, rel=0.15)


@bounded
async def test_an_idle_runs_share_goes_to_the_others() -> None:
    gate = ShareGate(capacity=2)
    gate.add_run("a", 1.0)
    gate.add_run("b", 9.0)  # a large share, but no work
    log: Log = []
    await asyncio.gather(*_workers(gate, "a", 4, 10, log, lambda: _total(log) >= 2000))
    assert {run for run, _ in log} == {"a"}
    assert gate.stats()["b"]["tokens"] == 0
    assert gate.stats()["a"]["groups"] == len(log) >= 200

    # as many workers as slots: each turn is granted at once, and both slots are used together
    never_waited = True
    peak = 0

    async def alone() -> None:
        nonlocal never_waited, peak
        for _ in range(50):
            async with gate.turn("a"):
                never_waited &= gate.stats()["a"]["waiting"] == 0
                peak = max(peak, gate.stats()["a"]["inflight"])
                await asyncio.sleep(0)

    await asyncio.gather(alone(), alone())
    assert never_waited
    assert peak == 2


@bounded
async def test_each_worker_of_a_lone_run_progresses() -> None:
    gate = ShareGate(capacity=2)
    gate.add_run("a", 1.0)
    gate.add_run("b", 1.0)
    done = [0] * 4

    async def worker(i: int) -> None:
        while sum(done) < 400:
            async with gate.turn("a") as turn:
                await asyncio.sleep(0)
                turn.spend(5)
            done[i] += 1

    await asyncio.gather(*(worker(i) for i in range(4)))
    assert min(done) >= 50  # FIFO among one run's waiters: none starves


@bounded
async def test_no_hoarded_credit_after_an_idle_while() -> None:
    gate = ShareGate(capacity=2)
    gate.add_run("a", 1.0)
    gate.add_run("b", 1.0)
    log: Log = []
    stop = asyncio.Event()
    a = _workers(gate, "a", 4, 10, log, stop.is_set)
    while _total(log) < 20_000:  # a alone for a long while; b idle
        await asyncio.sleep(0)
    start = len(log)
    b = _workers(gate, "b", 4, 10, log, stop.is_set)
    while _total(log[start:]) < 2000:
        await asyncio.sleep(0)
    stop.set()
    await asyncio.gather(*a, *b)
    assert 0.4 <= _fraction(log[start:], "b", 2000) <= 0.6


@bounded
async def test_no_hoarded_credit_when_every_run_was_idle() -> None:
    gate = ShareGate(capacity=2)
    gate.add_run("a", 1.0)
    gate.add_run("b", 1.0)
    log: Log = []
    await asyncio.gather(*_workers(gate, "a", 4, 10, log, lambda: _total(log) >= 20_000))
    start = len(log)  # now nothing is active; b comes back first, then a
    stop = lambda: _total(log[start:]) >= 2000  # noqa: E731
    await asyncio.gather(*_workers(gate, "b", 4, 10, log, stop), *_workers(gate, "a", 4, 10, log, stop))
    assert 0.4 <= _fraction(log[start:], "b", 2000) <= 0.6


@bounded
async def test_a_grant_is_charged_its_estimate_at_once() -> None:
    """Two slots free up one after the other with a's and b's waiters queued (a's first), at equal vtime:
    the first grant charges a its mean group, so the second goes to b — not to a again as if a's first
    group in flight cost nothing."""
    gate = ShareGate(capacity=2)
    for run in "abc":
        gate.add_run(run, 1.0)
    for run in "ab":
        async with gate.turn(run) as turn:
            turn.spend(10)
    assert gate.stats()["a"]["vtime"] == gate.stats()["b"]["vtime"]
    releases = [asyncio.Event(), asyncio.Event()]
    holders = [asyncio.create_task(_hold(gate, "c", release)) for release in releases]
    await _settle()
    waiters = [asyncio.create_task(_hold(gate, run, asyncio.Event())) for run in "aabb"]
    await _settle()
    assert (gate.stats()["a"]["waiting"], gate.stats()["b"]["waiting"]) == (2, 2)
    for release in releases:
        release.set()
        await _settle()
    assert (gate.stats()["a"]["inflight"], gate.stats()["b"]["inflight"]) == (1, 1)
    for task in waiters:
        task.cancel()
    await asyncio.gather(*holders, *waiters, return_exceptions=True)
    assert gate.inflight == 0


@bounded
async def test_capacity_is_never_exceeded() -> None:
    gate = ShareGate(capacity=3)
    now = peak = 0
    for run, share in (("a", 1.0), ("b", 2.0), ("c", 0.5)):
        gate.add_run(run, share)

    async def worker(run: str, seed: int) -> None:
        nonlocal now, peak
        rng = random.Random(seed)
        for _ in range(100):
            async with gate.turn(run) as turn:
                now += 1
                peak = max(peak, now)
                for _ in range(rng.randint(0, 4)):
                    await asyncio.sleep(0)
                turn.spend(rng.randint(1, 20))
                now -= 1

    await asyncio.gather(*(worker(run, i) for i, run in enumerate("abc" * 3)))
    assert peak == 3
    assert gate.inflight == 0
    assert all(stats["groups"] == 300 for stats in gate.stats().values())


@bounded
async def test_a_turn_ended_by_an_exception_frees_its_slot() -> None:
    gate = ShareGate(capacity=1)
    gate.add_run("a", 1.0)
    entered = asyncio.Event()
    fail = asyncio.Event()

    async def failing() -> None:
        async with gate.turn("a") as turn:
            entered.set()
            await fail.wait()
            turn.spend(7)
            raise RuntimeError("the engine failed mid-group")

    first = asyncio.create_task(failing())
    await entered.wait()
    waiter = asyncio.create_task(_hold(gate, "a", asyncio.Event(), 3))
    await _settle()
    assert gate.stats()["a"]["waiting"] == 1
    fail.set()
    with pytest.raises(RuntimeError, match="mid-group"):
        await first
    await _settle()
    stats = gate.stats()["a"]
    assert (stats["tokens"], stats["groups"], stats["waiting"], stats["inflight"]) == (7, 0, 0, 1)  # the waiter's
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    async with gate.turn("a") as turn:  # the slot came back from the failed turn and the cancelled one
        turn.spend(1)
    assert gate.stats()["a"]["tokens"] == 8
    assert gate.stats()["a"]["groups"] == 1
    assert gate.inflight == 0


@bounded
async def test_cancelling_a_waiting_turn_leaks_nothing() -> None:
    gate = ShareGate(capacity=1)
    gate.add_run("a", 1.0)
    gate.add_run("b", 1.0)
    release = asyncio.Event()
    holder = asyncio.create_task(_hold(gate, "a", release, 10))
    await _settle()
    cancelled = asyncio.create_task(_hold(gate, "b", asyncio.Event()))
    await _settle()
    assert gate.stats()["b"]["waiting"] == 1
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert gate.stats()["b"]["waiting"] == 0
    release.set()
    await holder
    async with gate.turn("b") as turn:
        assert gate.stats()["b"]["inflight"] == 1
        turn.spend(4)
    assert {run: (stats["inflight"], stats["waiting"]) for run, stats in gate.stats().items()} == {
        "a": (0, 0),
        "b": (0, 0),
    }
    assert gate.inflight == 0


@bounded
async def test_a_grant_made_as_its_waiter_is_cancelled_goes_to_the_next() -> None:
    gate = ShareGate(capacity=1)
    gate.add_run("a", 1.0)
    gate.add_run("b", 1.0)
    async with gate.turn("a") as turn:
        second = asyncio.create_task(_hold(gate, "b", asyncio.Event()))  # granted first, never runs its turn
        await _settle()
        third = asyncio.create_task(_hold(gate, "a", asyncio.Event(), 5))
        await _settle()
        assert gate.stats()["b"]["waiting"] == 1
        assert gate.stats()["a"]["waiting"] == 1
        turn.spend(10)
    # the exit granted the slot to the second (b's vtime is lower); it is cancelled before it runs
    assert gate.stats()["b"]["inflight"] == 1
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    await _settle()
    assert gate.stats()["a"]["inflight"] == 1  # the third has the slot
    third.cancel()
    with pytest.raises(asyncio.CancelledError):
        await third
    assert gate.inflight == 0
    assert gate.stats()["b"]["groups"] == 0
    assert gate.stats()["b"]["vtime"] == 0.0  # the abandoned grant is not charged
    async with gate.turn("b"):
        pass


@bounded
async def test_remove_run_fails_its_waiters_and_the_others_continue() -> None:
    gate = ShareGate(capacity=1)
    gate.add_run("a", 1.0)
    gate.add_run("b", 1.0)
    release = asyncio.Event()
    inflight_b = asyncio.create_task(_hold(gate, "b", release, 6))
    await _settle()
    waiting_b = [asyncio.create_task(_hold(gate, "b", asyncio.Event())) for _ in range(2)]
    waiting_a = asyncio.create_task(_hold(gate, "a", asyncio.Event(), 2))
    await _settle()
    assert gate.stats()["b"]["waiting"] == 2
    gate.remove_run("b")
    for task in waiting_b:
        with pytest.raises(RunRemoved):
            await task
    assert "b" not in gate.stats()
    assert not waiting_a.done()  # b's turn in flight still holds the slot
    release.set()
    await inflight_b  # finishes normally
    await _settle()
    assert gate.stats()["a"]["inflight"] == 1  # then a gets it
    waiting_a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting_a
    with pytest.raises(KeyError, match="'b'"):
        gate.turn("b")
    with pytest.raises(KeyError, match="unknown run 'nope'"):
        gate.turn("nope")
    gate.remove_run("nope")  # ignored
    async with gate.turn("a") as turn:
        turn.spend(1)
    assert gate.inflight == 0


def test_bad_capacity_and_shares_are_refused() -> None:
    for capacity in (0, -1):
        with pytest.raises(ValueError, match="capacity"):
            ShareGate(capacity)
    gate = ShareGate(1)
    for share in (0, 0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="share"):
            gate.add_run("a", share)
    assert gate.stats() == {}
    gate.add_run("a", 1.0)
    gate.add_run("a", 2.5)  # re-adding updates the share
    assert gate.stats()["a"]["share"] == 2.5


@bounded
async def test_stats_count_tokens_and_groups() -> None:
    gate = ShareGate(capacity=2)
    gate.add_run("a", 1.0)
    gate.add_run("b", 2.0)
    for _ in range(5):
        async with gate.turn("a") as turn:
            assert gate.stats()["a"]["inflight"] == 1
            turn.spend(3)
            turn.spend(4)  # more than once
    for _ in range(2):
        async with gate.turn("b") as turn:
            turn.spend(10)
    async with gate.turn("b") as turn:
        turn.spend(0)
        with pytest.raises(ValueError, match=">= 0"):
            turn.spend(-1)
    with pytest.raises(RuntimeError, match="ended"):
        turn.spend(1)
    stats = gate.stats()
    assert {run: {k: v for k, v in s.items() if k != "vtime"} for run, s in stats.items()} == {
        "a": {"share": 1.0, "tokens": 35, "groups": 5, "waiting": 0, "inflight": 0},
        "b": {"share": 2.0, "tokens": 20, "groups": 3, "waiting": 0, "inflight": 0},
    }
    assert stats["a"]["vtime"] == pytest.approx(35.0)
    # b was idle while a ran alone: it starts at a's last start (28), not at 0, then 20 tokens / share 2
    assert stats["b"]["vtime"] == pytest.approx(28.0 + 10.0)


@bounded
async def test_a_paused_run_holds_no_slot_and_gets_none() -> None:
    # Run "a" takes the one slot, then its engine pauses (a weight update left hanging) with the turn still
    # open: "b" must get the slot meanwhile, and "a" no new turn until it resumes.
    gate = ShareGate(capacity=1)
    paused = {"a": False}
    gate.add_run("a", 1.0)
    gate.add_run("b", 1.0)
    gate.watch("a", lambda: paused["a"])
    frozen = gate.turn("a")
    await frozen.__aenter__()
    paused["a"] = True
    async with gate.turn("b") as turn:  # hangs (the test times out) if a's frozen turn holds the slot
        turn.spend(1)
    again = gate.turn("a")
    waiting_a = asyncio.create_task(again.__aenter__())
    await asyncio.sleep(0.3)  # a few of the gate's re-dispatches: none grants "a" while it is paused
    assert not waiting_a.done()
    paused["a"] = False
    await frozen.__aexit__(None, None, None)
    await asyncio.wait_for(waiting_a, timeout=2)
    await again.__aexit__(None, None, None)
    assert gate.inflight == 0
