"""Token shares between the training runs one rollout server serves: start-time fair queueing.

One server process may serve several runs at once, each with its own engine and prompt worker
coroutines in the one event loop. :class:`ShareGate` admits their groups: ``capacity`` is the most
groups being processed at once across all runs, and each run's ``share`` (``rollout.share``, a
weight > 0) is the part of the generated tokens it gets while runs contend for those slots —
measured over time, not per request, so a run with long completions gets fewer groups, not more
tokens.

The gate is start-time fair queueing on virtual time. Each run's ``vtime`` is the tokens charged to
it divided by its share; a free slot goes to the waiting run with the smallest ``vtime`` (ties: the
waiter that came first). Tokens are known only when a group ends, so a grant charges an estimate
(the run's mean tokens per finished turn, 0 before its first) — a run holding several slots is not
charged as if it held one — and the turn's end corrects the charge to what it spent, a turn ended by
an exception included. A run with no work waiting takes no slot and its share goes to the others; a
run that becomes active again (no waiter and nothing in flight before) starts at
``max(its vtime, the smallest vtime of the active runs)`` — or, with none active, of the last start
granted — so idle time is not credit it could later spend shutting the others out.

Single-threaded asyncio: every change happens between awaits, each waiter is one future. A waiter
cancelled after its grant was made (the grant and the cancel in the same loop iteration) hands the
slot on, so no slot leaks and no grant waits on a coroutine that is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

PAUSED_POLL_S = 0.1
"""How often a waiter of a full gate looks again: a run whose engine paused since (a weight update) gives
its slots back without a turn ending."""


def _never() -> bool:
    return False


class RunRemoved(RuntimeError):
    """The run was removed (finished or died) while this turn waited for a slot."""


@dataclass
class _Waiter:
    seq: int  # arrival order: the tie-break between runs of equal vtime
    future: asyncio.Future[Turn]


@dataclass
class _Run:
    run_id: str
    share: float
    vtime: float = 0.0
    tokens: int = 0  # spent by finished turns, failed ones included
    turns: int = 0  # finished turns, failed ones included: the estimate's denominator
    groups: int = 0  # turns that ended without an exception
    inflight: int = 0
    removed: bool = False
    waiters: deque[_Waiter] = field(default_factory=deque)
    paused: Callable[[], bool] = _never
    """True while the run's engine is paused (a weight update): its turns hold no slot and it gets none."""

    @property
    def active(self) -> bool:
        return bool(self.waiters) or self.inflight > 0

    def estimate(self) -> float:
        """Tokens a new turn is expected to spend: the mean of the finished ones, 0 before the first."""
        return self.tokens / self.turns if self.turns else 0.0


class Turn:
    """One granted slot: the group's work runs inside it and reports its tokens with :meth:`spend`."""

    def __init__(self, run: _Run) -> None:
        self._run = run
        self.charged = run.estimate() / run.share  # virtual time charged at the grant
        self.spent = 0
        self.open = True

    def spend(self, tokens: int) -> None:
        """Count ``tokens`` completion tokens generated for this turn's group (may be called more than once)."""
        if tokens < 0:
            raise ValueError(f"spend: tokens must be >= 0, got {tokens}")
        if not self.open:
            raise RuntimeError(f"spend: the turn of run {self._run.run_id!r} has already ended")
        self.spent += tokens


class ShareGate:
    """Admission of groups across runs: at most ``capacity`` at once, tokens in proportion to shares."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"ShareGate: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.inflight = 0
        self._runs: dict[str, _Run] = {}
        self._seq = itertools.count()
        self._vclock = 0.0  # the largest start vtime granted: the floor when no run is active

    def add_run(self, run_id: str, share: float) -> None:
        """Register a run, or update the share of one already registered (its vtime is kept)."""
        if not share > 0:
            raise ValueError(f"ShareGate: run {run_id!r}: share must be > 0, got {share}")
        run = self._runs.get(run_id)
        if run is None:
            self._runs[run_id] = _Run(run_id, float(share))
        else:
            run.share = float(share)

    def watch(self, run_id: str, paused: Callable[[], bool]) -> None:
        """``paused()``: whether the run's engine is paused now. A paused run's generations are frozen (or
        queued) in its engine: their turns stop counting against ``capacity`` and the run is granted no new
        one until it resumes, so a weight update that hangs stalls that run alone. (When it resumes the
        fleet may briefly run more than ``capacity`` generations.)"""
        self._runs[run_id].paused = paused

    def remove_run(self, run_id: str) -> None:
        """Forget a run that finished or died: its waiters get :class:`RunRemoved`, its turns in flight
        finish normally (and hold their slots until they do). Unknown runs are ignored."""
        run = self._runs.pop(run_id, None)
        if run is None:
            return
        run.removed = True
        while run.waiters:
            waiter = run.waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(RunRemoved(f"run {run_id!r} was removed while its turn waited"))

    def turn(self, run_id: str) -> contextlib.AbstractAsyncContextManager[Turn]:
        """Wait for a slot for one group of ``run_id``; the slot is freed when the block exits."""
        run = self._runs.get(run_id)
        if run is None:
            raise KeyError(f"ShareGate: unknown run {run_id!r} (known: {sorted(self._runs)}); add_run it first")
        return self._turn(run)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per registered run: share, tokens (spent in total), groups (completed), waiting, inflight, vtime."""
        return {
            run_id: {
                "share": run.share,
                "tokens": run.tokens,
                "groups": run.groups,
                "waiting": len(run.waiters),
                "inflight": run.inflight,
                "vtime": run.vtime,
            }
            for run_id, run in self._runs.items()
        }

    @contextlib.asynccontextmanager
    async def _turn(self, run: _Run) -> AsyncIterator[Turn]:
        turn = await self._acquire(run)
        ok = False
        try:
            yield turn
            ok = True
        finally:
            self._release(turn, ok=ok)

    async def _acquire(self, run: _Run) -> Turn:
        if run.removed:
            raise RunRemoved(f"run {run.run_id!r} was removed")
        if not run.active:
            self._activate(run)
        waiter = _Waiter(next(self._seq), asyncio.get_running_loop().create_future())
        run.waiters.append(waiter)
        self._dispatch()
        try:
            while not waiter.future.done():  # done at once when a slot was free: no suspension
                await asyncio.wait([waiter.future], timeout=PAUSED_POLL_S)
                self._dispatch()  # a run may have paused meanwhile, its slots free
            return waiter.future.result()
        except asyncio.CancelledError:
            self._abandon(run, waiter)
            raise

    def _activate(self, run: _Run) -> None:
        """No hoarded credit: a run coming back from idle starts no earlier than the active runs."""
        active = [r.vtime for r in self._runs.values() if r is not run and r.active]
        run.vtime = max(run.vtime, min(active) if active else self._vclock)

    def _abandon(self, run: _Run, waiter: _Waiter) -> None:
        """A cancelled waiter: drop it, or when its grant was already made, give the slot back."""
        future = waiter.future
        if not future.done() or future.cancelled():
            with contextlib.suppress(ValueError):
                run.waiters.remove(waiter)
            return
        if future.exception() is not None:  # RunRemoved: nothing was granted (and the exception is retrieved)
            return
        turn = future.result()
        run.vtime -= turn.charged  # never ran: undo the estimate, count no turn
        turn.open = False
        run.inflight -= 1
        self.inflight -= 1
        self._dispatch()

    def _release(self, turn: Turn, *, ok: bool) -> None:
        run = turn._run
        turn.open = False
        run.vtime += turn.spent / run.share - turn.charged
        run.tokens += turn.spent
        run.turns += 1
        if ok:
            run.groups += 1
        run.inflight -= 1
        self.inflight -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant free slots, each to the waiting run with the smallest vtime (ties: the oldest waiter)."""
        while self.inflight - sum(r.inflight for r in self._runs.values() if r.paused()) < self.capacity:
            run = self._next_run()
            if run is None:
                return
            waiter = run.waiters.popleft()
            if waiter.future.done():  # cancelled, not yet dropped by its coroutine
                continue
            self._vclock = max(self._vclock, run.vtime)
            turn = Turn(run)
            run.vtime += turn.charged
            run.inflight += 1
            self.inflight += 1
            waiter.future.set_result(turn)

    def _next_run(self) -> _Run | None:
        waiting = [r for r in self._runs.values() if r.waiters and not r.paused()]
        return min(waiting, key=lambda r: (r.vtime, r.waiters[0].seq), default=None)
