"""A fleet server's fair-share gate in the simulation: :mod:`rollout_server.shares`' rules on SimPy events.

A rollout server serving several runs lets at most ``capacity`` groups generate at once, and under
contention gives each run generated tokens in proportion to its ``share`` by start-time fair queueing: a
run's virtual time is the tokens charged to it over its share; a free slot goes to the waiting run with
the least (ties: the group that asked first). A grant charges the run's mean tokens per finished group on
this server (0 before its first), and the group's end corrects the charge to what it generated. A run with
nothing waiting and nothing generating takes no slot, its share going to the others; when it asks again it
starts at ``max(its virtual time, the least of the active runs')`` — or, none active, the last start
granted — so idle time is no credit. The real gate is asyncio (futures, cancellation, runs joining and
leaving); this one has a fixed list of runs and groups that always finish.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import simpy


@dataclass
class Turn:
    """One group's place at the gate: ``granted`` fires when it may generate."""

    run: int
    seq: int
    granted: simpy.Event
    charged: float = 0.0


@dataclass
class _Share:
    share: float
    vtime: float = 0.0
    tokens: float = 0.0
    turns: int = 0
    inflight: int = 0
    waiters: deque[Turn] = field(default_factory=deque)

    @property
    def active(self) -> bool:
        return bool(self.waiters) or self.inflight > 0


class Gate:
    """At most ``capacity`` groups generating at once across runs ``0 .. len(shares) - 1``, tokens by share."""

    def __init__(self, env: simpy.Environment, *, capacity: int, shares: Sequence[float]) -> None:
        if capacity < 1:
            raise ValueError(f"gate capacity must be >= 1, got {capacity}")
        if not all(s > 0 for s in shares):
            raise ValueError(f"shares must be > 0, got {list(shares)}")
        self.env, self.capacity, self.inflight = env, capacity, 0
        self.runs = [_Share(float(s)) for s in shares]
        self._seq = itertools.count()
        self._vclock = 0.0

    def turn(self, run: int) -> Turn:
        """Ask for a slot for one group of ``run``; granted at once (``granted`` already triggered) when free."""
        r = self.runs[run]
        if not r.active:
            active = [o.vtime for o in self.runs if o is not r and o.active]
            r.vtime = max(r.vtime, min(active) if active else self._vclock)
        t = Turn(run, next(self._seq), self.env.event())
        r.waiters.append(t)
        self._dispatch()
        return t

    def release(self, turn: Turn, tokens: float) -> None:
        """The group of ``turn`` generated ``tokens``: correct its charge and free its slot."""
        r = self.runs[turn.run]
        r.vtime += tokens / r.share - turn.charged
        r.tokens += tokens
        r.turns += 1
        r.inflight -= 1
        self.inflight -= 1
        self._dispatch()

    def _dispatch(self) -> None:
        while self.inflight < self.capacity:
            waiting = [r for r in self.runs if r.waiters]
            if not waiting:
                return
            r = min(waiting, key=lambda o: (o.vtime, o.waiters[0].seq))
            t = r.waiters.popleft()
            self._vclock = max(self._vclock, r.vtime)
            t.charged = (r.tokens / r.turns if r.turns else 0.0) / r.share
            r.vtime += t.charged
            r.inflight += 1
            self.inflight += 1
            t.granted.succeed()
