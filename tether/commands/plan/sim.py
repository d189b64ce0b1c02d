"""A discrete-event simulation of tether's protocol on SimPy: admission, generation, buffer, learner, sync.

It follows the real processes step by step, so a prediction differs from a run only where a rate does:

* **Admission** (:func:`buffer.codec.admission_allowance`): the learner issues prompts only while
  ``issued − given back ≤ (max_staleness + version + 1)·B·sync_every``, at the start of each step and
  whenever a stale group is given back — where the real feed runs.
* **Rollout servers** take prompts in order, ``slots_per_server`` at a time, and generate each group on a
  processor-sharing engine (:class:`Engine`); a group's policy version is the server's version when it
  started (its oldest token, as the learner counts staleness).
* **The buffer** holds groups as they finish; **the learner** takes what is there oldest first (by version),
  drops (and gives back) any more than ``max_staleness`` behind, and once it has ``B`` usable ones waits for
  the groups still generating that would be too old next step (``stale_wait``), trains on the oldest ``B``,
  keeps the rest for the next step, and every ``sync_every`` steps publishes.
* **Weight sync**: during an update no server starts a group of the run and ``keep`` pauses its in-flight ones
  for the transfer (their tokens then carry the new version, the oldest still the old one); ``drain`` first lets
  in-flight groups finish, and the learner waits for that before the transfer.

Figures are taken after ``warmup`` steps, as :mod:`tether.commands.plan.calibrate` measures a run.
:class:`RunSim` is one run's side of all this on a set of engines; :mod:`tether.commands.plan.runs` puts several
on one fleet's engines, each server's groups admitted by a fair-share gate (:mod:`tether.commands.plan.gate`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import simpy

from tether.commands.plan.fleet import FleetSpec
from tether.commands.plan.gate import Gate

_EPS = 1e-9


@dataclass
class _Job:
    remaining: float
    cap: float
    done: simpy.Event
    owner: int


class Engine:
    """One rollout server's decode capacity, shared equally by its groups (capped per group).

    Each group belongs to a run (``owner``); a run's groups are held while its weights load (:meth:`hold`),
    and the others share the engine meanwhile. ``tokens`` counts what each run's groups have generated."""

    def __init__(self, env: simpy.Environment, *, tokens_per_s: float) -> None:
        self.env, self.tokens_per_s = env, tokens_per_s
        self.jobs: list[_Job] = []
        self.held: set[int] = set()
        self.busy_s = 0.0
        self.tokens: Counter[int] = Counter()
        self._wake = env.event()
        env.process(self._run())

    def submit(self, tokens: float, cap: float, *, owner: int = 0) -> simpy.Event:
        job = _Job(remaining=tokens, cap=cap, done=self.env.event(), owner=owner)
        self.jobs.append(job)
        self.kick()
        return job.done

    def hold(self, owner: int) -> None:
        self.held.add(owner)
        self.kick()

    def release(self, owner: int) -> None:
        self.held.discard(owner)
        self.kick()

    def kick(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _rates(self, jobs: list[_Job]) -> list[float]:
        # Water-filling: a group below its fair share keeps its cap; the rest share what is left.
        order = sorted(range(len(jobs)), key=lambda i: jobs[i].cap)
        rates, left, n = [0.0] * len(jobs), self.tokens_per_s, len(jobs)
        for k, i in enumerate(order):
            share = left / (n - k)
            rates[i] = min(jobs[i].cap, share)
            left -= rates[i]
        return rates

    def _run(self):
        env = self.env
        while True:
            active = [j for j in self.jobs if j.owner not in self.held]  # a group submitted meanwhile starts next round
            if not active:
                yield self._wake
                self._wake = env.event()
                continue
            rates = self._rates(active)
            dt = min(j.remaining / r for j, r in zip(active, rates, strict=True))
            t0 = env.now
            yield env.timeout(dt) | self._wake
            elapsed = env.now - t0
            self.busy_s += elapsed
            for j, r in zip(active, rates, strict=True):
                j.remaining -= r * elapsed
                self.tokens[j.owner] += r * elapsed
            finished = [j for j, r in zip(active, rates, strict=True) if j.remaining <= _EPS * max(1.0, r)]
            if elapsed >= dt - _EPS and not finished:  # the timeout fired: its job is done whatever rounding says
                finished = [min(active, key=lambda j: j.remaining)]
            for j in finished:
                self.jobs.remove(j)
                j.done.succeed()
            if self._wake.triggered:
                self._wake = env.event()


@dataclass
class SimResult:
    samples_per_s: float
    steps_per_s: float
    learner_idle: float
    """Share of the measured time the learner waited for data."""
    sync_share: float
    """Share of the measured time spent in weight updates."""
    rollout_busy: float
    """Mean share of the measured time a server was generating."""
    staleness: dict[int, int]
    """Groups trained on, by staleness (after warm-up)."""
    dropped_stale: int
    max_buffer_groups: int
    """Most groups waiting in the trajectories stream at once."""
    groups_per_s: float
    step_times: list[float] = field(default_factory=list)

    @property
    def staleness_mean(self) -> float:
        total = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / total if total else 0.0


@dataclass
class _Group:
    version: int
    tokens: float


@dataclass
class _Step:
    """One learner step as it happened."""

    start: float
    end: float
    wait: float
    """Waiting for data, reading included."""
    sync: float
    groups: int
    staleness: Counter[int]
    dropped: int
    busy: float
    """The engines' generating seconds so far, summed, at the step's end."""


class RunSim:
    """One run's side of the protocol on ``engines``: prompts, admission, buffer, learner, weight updates.

    ``key`` tags its groups on the engines; with ``gates`` (one per engine) each group waits for its turn at
    its server's gate before it generates, as on a fleet serving several runs."""

    def __init__(
        self,
        env: simpy.Environment,
        fleet: FleetSpec,
        rng: np.random.Generator,
        engines: list[Engine],
        *,
        key: int = 0,
        gates: list[Gate] | None = None,
    ) -> None:
        self.f, self.rng, self.env, self.engines, self.key = fleet, rng, env, engines, key
        self.prompts = simpy.Store(env)
        self.buffer = simpy.Store(env)
        self.version = 0
        self.issued = self.given_back = 0
        self.open = env.event()  # untriggered while a weight update holds new groups back
        self.open.succeed()
        self.in_flight = 0
        self.generating: Counter[int] = Counter()  # groups in generation, by the version they started at
        self.held: list[_Group] = []  # finished groups the learner read and kept for a later step
        self.drained = env.event()
        self.max_buffer = 0
        self.steps: list[_Step] = []
        for i, engine in enumerate(engines):
            for _ in range(fleet.slots_per_server):
                env.process(self._slot(engine, gates[i] if gates else None))

    def feed(self) -> None:
        f = self.f
        bound = (f.max_staleness + self.version + 1) * f.prompts_per_version
        for _ in range(max(0, bound - (self.issued - self.given_back))):
            self.prompts.put(None)
            self.issued += 1

    def _slot(self, engine: Engine, gate: Gate | None):
        f, env = self.f, self.env
        while True:
            yield self.prompts.get()
            yield self.open
            turn = gate.turn(self.key) if gate else None
            if turn and not turn.granted.triggered:
                yield turn.granted
                if not self.open.triggered:  # an update began while the group waited for its turn
                    yield self.open
            lengths = self.f.lengths.sample(self.rng, f.n)
            version, tokens = self.version, float(lengths.sum())
            cap = f.seq_tokens_per_s * tokens / float(lengths.max())  # the longest sample sets the pace
            self.in_flight += 1
            self.generating[version] += 1
            yield engine.submit(tokens, cap, owner=self.key)
            if turn:
                gate.release(turn, tokens)
            self.in_flight -= 1
            if self.in_flight == 0 and not self.drained.triggered:
                self.drained.succeed()
            if f.group_overhead_s:
                yield env.timeout(f.group_overhead_s)
            self.buffer.put(_Group(version=version, tokens=tokens))
            self.generating[version] -= 1  # as a server acknowledges its prompt: once the group is written
            self.max_buffer = max(self.max_buffer, len(self.buffer.items))

    def sync(self):
        f, env = self.f, self.env
        self.open = env.event()
        if f.inflight == "drain" and self.in_flight:
            self.drained = env.event()
            yield self.drained
        for e in self.engines:
            e.hold(self.key)
        yield env.timeout(f.sync_seconds(self.rng))
        self.version += 1
        for e in self.engines:
            e.release(self.key)
        self.open.succeed()

    def learner(self, steps: int | None = None, on_step: Callable[[], None] | None = None):
        """``steps`` learner steps (None: until the simulation stops), each recorded in ``self.steps``."""
        f, env = self.f, self.env
        step = 0
        while steps is None or step < steps:
            step += 1
            t_start = env.now
            self.feed()
            got: list[_Group] = []
            pool, self.held = self.held + list(self.buffer.items), []  # what is there, oldest first
            self.buffer.items.clear()
            dropped = sum(self._take(g, got) for g in sorted(pool, key=lambda g: g.version))
            while len(got) < f.train_batch_size:
                dropped += self._take((yield self.buffer.get()), got)
            due = self.version - f.max_staleness  # started then or before: too old for the next step
            while f.stale_wait and any(c for v, c in self.generating.items() if v <= due):
                dropped += self._take((yield self.buffer.get()), got)
            got.sort(key=lambda g: g.version)
            got, self.held = got[: f.train_batch_size], got[f.train_batch_size :]
            stale = Counter(self.version - g.version for g in got)
            if f.read_s:
                yield env.timeout(f.read_s)
            t_data = env.now
            tokens = sum(g.tokens for g in got) + f.prompt_tokens * f.n * len(got)
            yield env.timeout(f.learner_seconds(tokens, self.rng))
            t_sync = env.now
            if step % f.sync_every == 0:
                yield env.process(self.sync())
            busy = sum(e.busy_s for e in self.engines)
            wait, sync = t_data - t_start, env.now - t_sync
            self.steps.append(_Step(t_start, env.now, wait, sync, len(got), stale, dropped, busy))
            if on_step:
                on_step()

    def _take(self, g: _Group, got: list[_Group]) -> bool:
        """Keep ``g`` for the step, or drop it (and give its slot back) when it is stale; whether dropped."""
        if self.version - g.version <= self.f.max_staleness:
            got.append(g)
            return False
        self.given_back += 1
        self.feed()
        return True

    def figures(self, first: int, last: int) -> SimResult:
        """Figures over steps ``first + 1`` to ``last`` (1-based): from the end of step ``first`` (0: the start)."""
        f, window = self.f, self.steps[first:last]
        t0, busy0 = (self.steps[first - 1].end, self.steps[first - 1].busy) if first else (0.0, 0.0)
        elapsed = window[-1].end - t0
        trained = sum(s.groups for s in window)
        stale: Counter[int] = Counter()
        for s in window:
            stale.update(s.staleness)
        return SimResult(
            samples_per_s=trained * f.n / elapsed,
            steps_per_s=len(window) / elapsed,
            learner_idle=sum(s.wait for s in window) / elapsed,
            sync_share=sum(s.sync for s in window) / elapsed,
            rollout_busy=(window[-1].busy - busy0) / (elapsed * f.servers),
            staleness=dict(sorted(stale.items())),
            dropped_stale=sum(s.dropped for s in window),
            max_buffer_groups=self.max_buffer,
            groups_per_s=trained / elapsed,
            step_times=[s.end - s.start for s in window],
        )


def simulate(fleet: FleetSpec, *, steps: int = 40, warmup: int = 5, seed: int = 0) -> SimResult:
    """Run ``steps`` learner steps; figures over the steps after the first ``warmup``."""
    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup})")
    env = simpy.Environment()
    engines = [Engine(env, tokens_per_s=fleet.server_tokens_per_s) for _ in range(fleet.servers)]
    run = RunSim(env, fleet, np.random.default_rng(seed), engines)
    env.run(until=env.process(run.learner(steps)))
    return run.figures(warmup, steps)


def simulate_mean(fleet: FleetSpec, *, steps: int = 40, warmup: int = 5, seeds: int = 3) -> SimResult:
    """The mean of ``seeds`` independent simulations (the staleness counts summed)."""
    return mean_result([simulate(fleet, steps=steps, warmup=warmup, seed=s) for s in range(seeds)])


def mean_result(runs: list[SimResult]) -> SimResult:
    """The mean of independent simulations' figures (staleness counts and drops summed, the buffer's peak)."""
    hist: Counter[int] = Counter()
    for r in runs:
        hist.update(r.staleness)

    def mean(attr: str) -> float:
        return float(np.mean([getattr(r, attr) for r in runs]))

    return SimResult(
        samples_per_s=mean("samples_per_s"),
        steps_per_s=mean("steps_per_s"),
        learner_idle=mean("learner_idle"),
        sync_share=mean("sync_share"),
        rollout_busy=mean("rollout_busy"),
        staleness=dict(sorted(hist.items())),
        dropped_stale=sum(r.dropped_stale for r in runs),
        max_buffer_groups=max(r.max_buffer_groups for r in runs),
        groups_per_s=mean("groups_per_s"),
        step_times=[t for r in runs for t in r.step_times],
    )
