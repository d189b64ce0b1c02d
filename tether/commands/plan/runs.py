"""Several runs on one rollout fleet: ``tether plan -c a.yaml -c b.yaml --learner-gpus 8 --rollout-gpus 16``.

A fleet (``tether rollout --runs a,b``, :mod:`rollout_server.fleet`) serves several runs, each with its own
learner. Here every rollout server is shared: each run issues prompts under its own admission bound; its
groups wait at their server's fair-share gate (:mod:`tether.commands.plan.gate`: at most ``capacity``
generating at once across the runs, tokens by ``rollout.share``, an idle run's share to the others), then
share the server's decode rate with every other group on it. Each run has its own learner GPUs, staleness
bound and weight updates; an update holds that run's groups only (it loads into the run's own engine, or
its own adapter on a shared base) while the others go on generating.

Each run warms up over its own ``warmup`` steps; from ``t0``, when the last of them has, each run is
measured over its next ``steps - warmup`` steps, and all keep training until every one has, so the fleet
stays contended throughout. The fleet's figures (busy time, each run's part of the generated tokens) are
over ``t0`` to that end. With one run this is :func:`tether.commands.plan.sim.simulate`, figure for figure.

Not modelled: GPU memory (a full fine-tuning run's engine holds its own copy of the weights, LoRA runs of
one base share one; either way an engine decodes at the rates file's rate), and a LoRA run's smaller weight
update (every run's update moves the full weights, as the one-run projection charges).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import simpy

from tether.commands.plan.fleet import FleetSpec
from tether.commands.plan.gate import Gate
from tether.commands.plan.project import Projection, horizon, projection, seeds_for
from tether.commands.plan.rates import Rates, fleet_for
from tether.commands.plan.sim import Engine, RunSim, SimResult, mean_result
from tether.config import TetherConfig


@dataclass(frozen=True)
class SharedRun:
    """One run on the fleet: its protocol and rates (the servers are the fleet's), its share and horizon."""

    fleet: FleetSpec
    share: float = 1.0
    steps: int = 40
    warmup: int = 5


@dataclass
class FleetResult:
    runs: list[SimResult]
    """Each run's figures over its own measured steps."""
    token_share: list[float]
    """Each run's part of the tokens the fleet generated from ``t0`` to the end."""
    rollout_busy: float
    """Mean share of that time a server was generating."""
    decode_used: float
    """Tokens generated over what the servers decode in that time at their full rate."""


def simulate_runs(runs: Sequence[SharedRun], *, capacity: int, seed: int = 0) -> FleetResult:
    """Simulate ``runs`` on one fleet whose servers each generate at most ``capacity`` groups at once."""
    first = runs[0].fleet
    for r in runs:
        if r.steps <= r.warmup:
            raise ValueError(f"steps ({r.steps}) must exceed warmup ({r.warmup})")
        if (r.fleet.servers, r.fleet.server_tokens_per_s) != (first.servers, first.server_tokens_per_s):
            raise ValueError("runs on one fleet must have the same servers and server_tokens_per_s")
    env = simpy.Environment()
    engines = [Engine(env, tokens_per_s=first.server_tokens_per_s) for _ in range(first.servers)]
    gates = [Gate(env, capacity=capacity, shares=[r.share for r in runs]) for _ in engines]
    lanes = [  # the first run draws as simulate() does with this seed, the others from streams of their own
        RunSim(env, r.fleet, np.random.default_rng(seed if i == 0 else [seed, i]), engines, key=i, gates=gates)
        for i, r in enumerate(runs)
    ]
    made: list[list[list[float]]] = [[] for _ in runs]  # per run, per step: every run's tokens at its end
    done = env.event()

    def openings() -> list[int] | None:
        """Each run's steps ended by ``t0`` (when the last run ends its warm-up); None before then."""
        if any(len(lane.steps) < r.warmup for lane, r in zip(lanes, runs, strict=True)):
            return None
        t0 = max(lane.steps[r.warmup - 1].end if r.warmup else 0.0 for lane, r in zip(lanes, runs, strict=True))
        return [sum(s.end <= t0 for s in lane.steps) for lane in lanes]

    def on_step(i: int) -> None:
        made[i].append([sum(e.tokens[k] for e in engines) for k in range(len(runs))])
        opened = None if done.triggered else openings()
        if opened is not None and all(
            len(lane.steps) >= a + r.steps - r.warmup for lane, a, r in zip(lanes, opened, runs, strict=True)
        ):
            done.succeed(opened)

    for i, lane in enumerate(lanes):
        env.process(lane.learner(on_step=partial(on_step, i)))
    env.run(until=done)
    ends = [a + r.steps - r.warmup for a, r in zip(done.value, runs, strict=True)]

    def mark(i: int, k: int) -> tuple[float, float, list[float]]:
        """Time, the engines' busy seconds and every run's tokens at the end of run ``i``'s step ``k`` (0: start)."""
        if k == 0:
            return 0.0, 0.0, [0.0] * len(runs)
        return lanes[i].steps[k - 1].end, lanes[i].steps[k - 1].busy, made[i][k - 1]

    t0, busy0, tokens0 = max((mark(i, r.warmup) for i, r in enumerate(runs)), key=lambda m: m[0])
    t1, busy1, tokens1 = max((mark(i, k) for i, k in enumerate(ends)), key=lambda m: m[0])
    tokens = [b - a for a, b in zip(tokens0, tokens1, strict=True)]
    span = (t1 - t0) * first.servers
    return FleetResult(
        runs=[lane.figures(a, k) for lane, a, k in zip(lanes, done.value, ends, strict=True)],
        token_share=[t / sum(tokens) for t in tokens],
        rollout_busy=(busy1 - busy0) / span,
        decode_used=sum(tokens) / (span * first.server_tokens_per_s),
    )


def mean_fleet(results: list[FleetResult]) -> FleetResult:
    """The mean of independent simulations of one fleet."""
    return FleetResult(
        runs=[mean_result(list(rs)) for rs in zip(*(r.runs for r in results), strict=True)],
        token_share=[float(np.mean(x)) for x in zip(*(r.token_share for r in results), strict=True)],
        rollout_busy=float(np.mean([r.rollout_busy for r in results])),
        decode_used=float(np.mean([r.decode_used for r in results])),
    )


@dataclass(frozen=True)
class FleetProjection:
    names: list[str]
    shares: list[float]
    runs: list[Projection]
    """Each run's projection (its learner GPUs, the fleet's rollout GPUs)."""
    result: FleetResult
    capacity: int

    @property
    def trajectory_mb_per_s(self) -> float:
        """Every run's trajectories: a fleet's slots write to the fleet's Redis."""
        return sum(p.trajectory_mb_per_s for p in self.runs)


def default_capacity(fleets: Sequence[FleetSpec], rates: Rates) -> int:
    """Groups one engine batches at the runs' largest ``n``: the fleet's ``rollout.prompt_workers`` to set."""
    return max(1, rates.rollout.max_num_seqs // max(f.n for f in fleets))


def project_runs(
    configs: Sequence[tuple[str, TetherConfig]],
    rates: Rates,
    *,
    learner_gpus: Sequence[int],
    rollout_gpus: int,
    capacity: int | None = None,
) -> FleetProjection:
    """``configs`` (name, config) on one fleet of ``rollout_gpus``, each with its own learner GPUs."""
    fleets = [
        fleet_for(cfg, rates, learner_gpus=g, rollout_gpus=rollout_gpus)
        for (_, cfg), g in zip(configs, learner_gpus, strict=True)
    ]
    capacity = capacity or default_capacity(fleets, rates)
    shares = [cfg.rollout.share for _, cfg in configs]
    runs = [SharedRun(f, s, *horizon(f)) for f, s in zip(fleets, shares, strict=True)]
    result = mean_fleet([simulate_runs(runs, capacity=capacity, seed=s) for s in range(seeds_for(fleets))])
    return FleetProjection(
        names=[name for name, _ in configs],
        shares=shares,
        runs=[
            projection(f, sim, rates, learner_gpus=g, rollout_gpus=rollout_gpus)
            for f, sim, g in zip(fleets, result.runs, learner_gpus, strict=True)
        ],
        result=result,
        capacity=capacity,
    )


def describe_runs(p: FleetProjection) -> str:
    r, servers = p.result, p.runs[0].fleet.servers
    head = (
        "| run | share | learner GPUs | max_staleness | samples/s | fleet tokens | learner waiting | weight sync "
        "| staleness mean | dropped stale |"
    )
    lines = [
        f"{len(p.runs)} runs on {p.runs[0].rollout_gpus} rollout GPUs ({servers} engines, each generating at most "
        f"{p.capacity} groups at once across the runs)",
        head,
        "|---|" + "---:|" * (head.count("|") - 2),
    ]
    for name, share, run, tokens in zip(p.names, p.shares, p.runs, r.token_share, strict=True):
        s = run.sim
        lines.append(
            f"| {name} | {share:g} | {run.learner_gpus} | {run.max_staleness} | {s.samples_per_s:,.1f} | "
            f"{tokens:.0%} | {s.learner_idle:.0%} | {s.sync_share:.0%} | {s.staleness_mean:.2f} | {s.dropped_stale} |"
        )
    rate = servers * p.runs[0].fleet.server_tokens_per_s
    lines += [
        f"fleet: busy {r.rollout_busy:.0%} of the time (generating), {r.decode_used:.0%} of its {rate:,.0f} "
        "tokens/s decode rate used",
        f"redis: {p.trajectory_mb_per_s:,.1f} MB/s of trajectories from all runs (one Redis, the fleet's) vs "
        f"{p.runs[0].redis_mb_per_s:,.0f} MB/s one Redis moves",
    ]
    if p.trajectory_mb_per_s > p.runs[0].redis_mb_per_s:
        lines.append("  WARNING: the runs' trajectories exceed what one Redis moves — it becomes the bottleneck.")
    return "\n".join(lines)
