"""A discrete-event simulation of tether's protocol on SimPy: admission, generation, buffer, learner, sync.

It follows the real processes step by step, so a prediction differs from a run only where a rate does:

* **Admission** (:func:`buffer.codec.admission_allowance`): the learner issues prompts only while
  ``issued − given back ≤ (max_staleness + version + 1)·B·sync_every``, at the start of each step and
  whenever a stale group is given back — where the real feed runs.
* **Rollout servers** take prompts in order, ``slots_per_server`` at a time, and generate each group on a
  processor-sharing engine (:class:`Engine`); a group's policy version is the server's version when it
  started (its oldest token, as the learner counts staleness).
* **The buffer** is FIFO; **the learner** reads groups oldest first, drops (and gives back) any more than
  ``max_staleness`` behind, trains on ``B`` usable ones, and every ``sync_every`` steps publishes.
* **Weight sync**: during an update no server starts a group and ``keep`` pauses in-flight ones for the
  transfer (their tokens then carry the new version, the oldest still the old one); ``drain`` first lets
  in-flight groups finish, and the learner waits for that before the transfer.

Figures are taken after ``warmup`` steps, as :mod:`tether.commands.plan.calibrate` measures a run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import simpy

from tether.commands.plan.fleet import Fleet

_EPS = 1e-9


@dataclass
class _Job:
    remaining: float
    cap: float
    done: simpy.Event


class Engine:
    """One rollout server's decode capacity, shared equally by its groups (capped per group)."""

    def __init__(self, env: simpy.Environment, *, tokens_per_s: float) -> None:
        self.env, self.tokens_per_s = env, tokens_per_s
        self.jobs: list[_Job] = []
        self.paused = False
        self.busy_s = 0.0
        self._wake = env.event()
        env.process(self._run())

    def submit(self, tokens: float, cap: float) -> simpy.Event:
        job = _Job(remaining=tokens, cap=cap, done=self.env.event())
        self.jobs.append(job)
        self.kick()
        return job.done

    def kick(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _rates(self) -> list[float]:
        # Water-filling: a group below its fair share keeps its cap; the rest share what is left.
        order = sorted(range(len(self.jobs)), key=lambda i: self.jobs[i].cap)
        rates, left, n = [0.0] * len(self.jobs), self.tokens_per_s, len(self.jobs)
        for k, i in enumerate(order):
            share = left / (n - k)
            rates[i] = min(self.jobs[i].cap, share)
            left -= rates[i]
        return rates

    def _run(self):
        env = self.env
        while True:
            if not self.jobs or self.paused:
                yield self._wake
                self._wake = env.event()
                continue
            active, rates = list(self.jobs), self._rates()  # a group submitted meanwhile starts next round
            dt = min(j.remaining / r for j, r in zip(active, rates, strict=True))
            t0 = env.now
            yield env.timeout(dt) | self._wake
            elapsed = env.now - t0
            self.busy_s += elapsed
            for j, r in zip(active, rates, strict=True):
                j.remaining -= r * elapsed
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


class _World:
    def __init__(self, fleet: Fleet, rng: np.random.Generator) -> None:
        self.f, self.rng = fleet, rng
        self.env = env = simpy.Environment()
        self.prompts = simpy.Store(env)
        self.buffer = simpy.Store(env)
        self.engines = [Engine(env, tokens_per_s=fleet.server_tokens_per_s) for _ in range(fleet.servers)]
        self.version = 0
        self.issued = self.given_back = 0
        self.open = env.event()  # untriggered while a weight update holds new groups back
        self.open.succeed()
        self.in_flight = 0
        self.drained = env.event()
        self.max_buffer = 0
        for engine in self.engines:
            for _ in range(fleet.slots_per_server):
                env.process(self._slot(engine))

    def feed(self) -> None:
        f = self.f
        bound = (f.max_staleness + self.version + 1) * f.prompts_per_version
        for _ in range(max(0, bound - (self.issued - self.given_back))):
            self.prompts.put(None)
            self.issued += 1

    def _slot(self, engine: Engine):
        f, env = self.f, self.env
        while True:
            yield self.prompts.get()
            yield self.open
            lengths = self.f.lengths.sample(self.rng, f.n)
            version, tokens = self.version, float(lengths.sum())
            cap = f.seq_tokens_per_s * tokens / float(lengths.max())  # the longest sample sets the pace
            self.in_flight += 1
            yield engine.submit(tokens, cap)
            self.in_flight -= 1
            if self.in_flight == 0 and not self.drained.triggered:
                self.drained.succeed()
            if f.group_overhead_s:
                yield env.timeout(f.group_overhead_s)
            self.buffer.put(_Group(version=version, tokens=tokens))
            self.max_buffer = max(self.max_buffer, len(self.buffer.items))

    def sync(self):
        f, env = self.f, self.env
        self.open = env.event()
        if f.inflight == "drain" and self.in_flight:
            self.drained = env.event()
            yield self.drained
        for e in self.engines:
            e.paused = True
            e.kick()
        yield env.timeout(f.sync_seconds(self.rng))
        self.version += 1
        for e in self.engines:
            e.paused = False
            e.kick()
        self.open.succeed()


def simulate(fleet: Fleet, *, steps: int = 40, warmup: int = 5, seed: int = 0) -> SimResult:
    """Run ``steps`` learner steps; figures over the steps after the first ``warmup``."""
    if steps <= warmup:
        raise ValueError(f"steps ({steps}) must exceed warmup ({warmup})")
    f, rng = fleet, np.random.default_rng(seed)
    w = _World(fleet, rng)
    env = w.env
    marks: dict[str, float] = {"wait": 0.0, "sync": 0.0}
    stale: Counter[int] = Counter()
    state = {"dropped": 0, "t0": 0.0, "busy0": 0.0, "trained": 0}
    step_times: list[float] = []

    def learner():
        for step in range(1, steps + 1):
            counting = step > warmup
            t_start = env.now
            w.feed()
            got: list[_Group] = []
            while len(got) < f.train_batch_size:
                g = yield w.buffer.get()
                s = w.version - g.version
                if s > f.max_staleness:
                    state["dropped"] += counting
                    w.given_back += 1
                    w.feed()
                    continue
                got.append(g)
                stale[s] += counting
            if f.read_s:
                yield env.timeout(f.read_s)
            t_data = env.now
            tokens = sum(g.tokens for g in got) + f.prompt_tokens * f.n * len(got)
            yield env.timeout(f.learner_seconds(tokens, rng))
            t_sync = env.now
            if step % f.sync_every == 0:
                yield env.process(w.sync())
            if counting:
                marks["wait"] += t_data - t_start
                marks["sync"] += env.now - t_sync
                state["trained"] += len(got)
                step_times.append(env.now - t_start)
            if step == warmup:
                state["t0"], state["busy0"] = env.now, sum(e.busy_s for e in w.engines)
                stale.clear()

    done = env.process(learner())
    env.run(until=done)
    elapsed = env.now - state["t0"]
    busy = sum(e.busy_s for e in w.engines) - state["busy0"]
    measured = steps - warmup
    return SimResult(
        samples_per_s=state["trained"] * f.n / elapsed,
        steps_per_s=measured / elapsed,
        learner_idle=marks["wait"] / elapsed,
        sync_share=marks["sync"] / elapsed,
        rollout_busy=busy / (elapsed * f.servers),
        staleness=dict(sorted(stale.items())),
        dropped_stale=state["dropped"],
        max_buffer_groups=w.max_buffer,
        groups_per_s=state["trained"] / elapsed,
        step_times=step_times,
    )


def simulate_mean(fleet: Fleet, *, steps: int = 40, warmup: int = 5, seeds: int = 3) -> SimResult:
    """The mean of ``seeds`` independent simulations (the staleness counts summed)."""
    runs = [simulate(fleet, steps=steps, warmup=warmup, seed=s) for s in range(seeds)]
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
