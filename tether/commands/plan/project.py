"""Projections: one GPU split, the best split of a GPU budget, and a sweep over splits and staleness.

Each projection simulates the config's protocol (:mod:`tether.commands.plan.sim`) on the fleet a rates file
gives (:func:`tether.commands.plan.rates.fleet_for`) and adds what the simulation implies for Redis: trajectory
bytes/s (payload, one pass) against one Redis's measured put → read → ack throughput, and the stream's
memory at its fullest. Past that throughput one Redis is the bottleneck; the planner says so (sharding
the trajectories stream is not built, see docs/PLANNER.md). The weight-sync line sets the update the
simulation charges (the rates' weight path, :mod:`tether.commands.plan.weights`) beside today's full push of the same
weights over the same link, so the difference the weight service makes at this fleet size is on the page.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from tether.commands.plan.fleet import FleetSpec
from tether.commands.plan.rates import Rates, fleet_for, full_bytes, group_bytes, weight_path
from tether.commands.plan.sim import SimResult, simulate_mean
from tether.commands.plan.weights import SyncCost, full_push, pull_of, sync_cost
from tether.config import TetherConfig

GROUPS_SIMULATED = 3000
"""Groups to simulate per projection after warm-up (at least 6 steps, at most 30): enough for a steady
rate at any batch size, few enough that a sweep of a large fleet takes a minute."""


def horizon(fleet: FleetSpec) -> tuple[int, int]:
    """(steps, warmup): warm-up covers the versions admission lets the rollout side run ahead."""
    warmup = fleet.max_staleness + 3
    measured = min(30, max(6, -(-GROUPS_SIMULATED // fleet.train_batch_size)))
    return warmup + measured, warmup


def seeds_for(fleets: list[FleetSpec]) -> int:
    """Independent simulations a projection averages: two, one when a batch is 256 groups or more."""
    return 2 if all(f.train_batch_size < 256 for f in fleets) else 1


@dataclass(frozen=True)
class Projection:
    learner_gpus: int
    rollout_gpus: int
    max_staleness: int
    fleet: FleetSpec
    sim: SimResult
    group_bytes: float
    redis_mb_per_s: float
    """One Redis's measured throughput (the rates file)."""
    weight_sync: SyncCost
    """The update the simulation charges (``fleet.sync_s``): the rates' weight path."""
    full_push: SyncCost
    pull: SyncCost
    """The store transport's pull on the same link (the rates' own when they pull, else fan-out 2)."""
    """Today's full push of the same weights over the same link, for comparison."""

    @property
    def trajectory_mb_per_s(self) -> float:
        """Payload written to the trajectories stream (generated groups, trained or dropped)."""
        produced = self.sim.groups_per_s * (1 + self.sim.dropped_stale / max(1, sum(self.sim.staleness.values())))
        return produced * self.group_bytes / 1e6

    @property
    def redis_memory_mb(self) -> float:
        """The stream at its fullest in the simulation."""
        return self.sim.max_buffer_groups * self.group_bytes / 1e6

    @property
    def redis_bound_mb(self) -> float:
        """Admission's worst case: every prompt in flight answered and waiting."""
        f = self.fleet
        return (f.max_staleness + 1) * f.prompts_per_version * self.group_bytes / 1e6

    @property
    def redis_saturated(self) -> bool:
        return self.trajectory_mb_per_s > self.redis_mb_per_s


def project(
    cfg: TetherConfig, rates: Rates, *, learner_gpus: int, rollout_gpus: int, max_staleness: int | None = None
) -> Projection:
    if max_staleness is not None:
        cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"max_staleness": max_staleness})})
    fleet = fleet_for(cfg, rates, learner_gpus=learner_gpus, rollout_gpus=rollout_gpus)
    steps, warmup = horizon(fleet)
    sim = simulate_mean(fleet, steps=steps, warmup=warmup, seeds=seeds_for([fleet]))
    return projection(fleet, sim, rates, learner_gpus=learner_gpus, rollout_gpus=rollout_gpus)


def projection(fleet: FleetSpec, sim: SimResult, rates: Rates, *, learner_gpus: int, rollout_gpus: int) -> Projection:
    """A simulation's figures with what they imply for Redis and the weight path."""
    return Projection(
        learner_gpus=learner_gpus,
        rollout_gpus=rollout_gpus,
        max_staleness=fleet.max_staleness,
        fleet=fleet,
        sim=sim,
        group_bytes=group_bytes(
            n=fleet.n, prompt_tokens=fleet.prompt_tokens, completion_tokens=fleet.lengths.mean_tokens()
        ),
        redis_mb_per_s=rates.redis.mb_per_s,
        **weight_costs(rates, servers=fleet.servers),
    )


def weight_costs(rates: Rates, *, servers: int) -> dict[str, SyncCost]:
    path, weights = weight_path(rates), full_bytes(rates)
    return {
        "weight_sync": sync_cost(path, full_bytes=weights, servers=servers),
        "full_push": sync_cost(full_push(path), full_bytes=weights, servers=servers),
        "pull": sync_cost(pull_of(path), full_bytes=weights, servers=servers),
    }


def best_split(
    cfg: TetherConfig, rates: Rates, *, total_gpus: int, learner_step: int = 8, max_staleness: int | None = None
) -> tuple[Projection, list[Projection]]:
    """Every split of ``total_gpus`` with learner GPUs a multiple of ``learner_step`` (and a whole number of
    rollout engines); the one with the most samples/s first, then all of them in order of learner GPUs."""
    tp = rates.rollout.tensor_parallel_size
    tried = []
    for learner in range(learner_step, total_gpus, learner_step):
        rollout = (total_gpus - learner) // tp * tp
        if rollout >= tp:
            tried.append(project(cfg, rates, learner_gpus=learner, rollout_gpus=rollout, max_staleness=max_staleness))
    if not tried:
        raise ValueError(f"no split of {total_gpus} GPUs leaves {learner_step}+ learner GPUs and one rollout engine")
    return max(tried, key=lambda p: p.sim.samples_per_s), tried


def describe(p: Projection) -> str:
    s, f = p.sim, p.fleet
    total = sum(s.staleness.values()) or 1
    hist = "  ".join(f"{k}: {v / total:.0%}" for k, v in sorted(s.staleness.items()))
    step_s = 1 / s.steps_per_s
    lines = [
        f"{p.learner_gpus} learner GPUs + {p.rollout_gpus} rollout GPUs ({f.servers} engines × {f.slots_per_server} "
        f"groups), max_staleness {f.max_staleness}, sync_every {f.sync_every}, inflight {f.inflight}",
        f"  throughput        {s.samples_per_s:,.1f} samples/s ({s.groups_per_s:,.2f} groups/s), "
        f"{step_s:.1f} s per learner step",
        f"  learner           busy {1 - s.learner_idle - s.sync_share:.0%}, waiting for data {s.learner_idle:.0%}, "
        f"weight sync {s.sync_share:.0%} of the time ({f.sync_s:.2f} s per update, {p.weight_sync.mode})",
        *describe_weight_sync(p.weight_sync, p.full_push, p.pull),
        f"  rollout           busy {s.rollout_busy:.0%} (generating)",
        f"  staleness         mean {s.staleness_mean:.2f}   {hist}   dropped stale {s.dropped_stale}",
        f"  redis             {p.trajectory_mb_per_s:,.1f} MB/s of trajectories ({p.group_bytes / 1e6:.2f} MB per "
        f"group) vs {p.redis_mb_per_s:,.0f} MB/s one Redis moves; memory {p.redis_memory_mb:,.0f} MB at its fullest "
        f"(admission bound {p.redis_bound_mb:,.0f} MB)",
    ]
    if p.redis_saturated:
        lines.append(
            "  WARNING: the trajectories exceed what one Redis moves — it becomes the bottleneck. See docs/PLANNER.md "
            "(buffer.compression, fewer bytes per token, a faster Redis host; sharding is not built)."
        )
    return "\n".join(lines)


def _bytes(n: float) -> str:
    if n >= 1e12:
        return f"{n / 1e12:,.2f} TB"
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.0f} MB"


def describe_weight_sync(used: SyncCost, today: SyncCost, pull: SyncCost) -> list[str]:
    """Today's full push, then the pull (``*`` marks the one simulated)."""

    def row(c: SyncCost, name: str) -> str:
        mark = "*" if c.path.mode == used.path.mode else " "
        hops = f"{c.hops} hop{'s' * (c.hops > 1)}"
        parts = f"{c.latency_s:.2f} + {c.encode_s:.2f} + {c.transfer_s:.2f} ({hops}) + {c.decode_s:.2f}"
        base = f"; a base (every {c.path.base_every}) {c.base_seconds:.2f} s" if c.path.is_delta else ""
        return (
            f"  {mark} {name:<30}{c.seconds:>8.2f} s{_bytes(c.origin_bytes):>11}{_bytes(c.wire_bytes):>11}   "
            f"{parts}{base}"
        )

    lines = [
        f"  {f'weight sync to {used.servers} servers':<34}per update origin out    on wire   "
        "= latency + encode + transfer + decode, s",
        row(today, "push, full (today)"),
    ]
    lines.append(row(pull, pull.path.label()))
    factor = pull.break_even(today)
    if factor is not None:
        p = pull.path
        cores = f"{p.codec_cores} core{'s' * (p.codec_cores > 1)}"
        lines += [
            f"    the pull is slower than the push here: its CPU codec ({pull.codec_s:.2f} s on {cores}) outweighs "
            f"what it saves on a {p.link_gb_per_s:g} GB/s link;",
            f"      it is faster on links below {p.link_gb_per_s / factor:.3g} GB/s, or with over "
            f"{factor * p.codec_cores:.3g} codec cores (--codec-cores)",
        ]
    return lines


def sweep(
    cfg: TetherConfig, rates: Rates, *, learner_gpus: int, ratios: list[float], staleness: list[int]
) -> list[Projection]:
    tp = rates.rollout.tensor_parallel_size
    out = []
    for eta in staleness:
        for r in ratios:
            rollout = max(tp, round(learner_gpus * r / tp) * tp)
            out.append(project(cfg, rates, learner_gpus=learner_gpus, rollout_gpus=rollout, max_staleness=eta))
    return out


def sweep_table(rows: list[Projection]) -> str:
    head = (
        "| max_staleness | learner GPUs | rollout GPUs | rollout:learner | samples/s | learner busy | rollout busy "
        "| staleness mean | sync share | Redis MB/s | Redis MB peak |"
    )
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for p in rows:
        s = p.sim
        lines.append(
            f"| {p.max_staleness} | {p.learner_gpus} | {p.rollout_gpus} | {p.rollout_gpus / p.learner_gpus:.2g} | "
            f"{s.samples_per_s:,.1f} | {1 - s.learner_idle - s.sync_share:.0%} | {s.rollout_busy:.0%} | "
            f"{s.staleness_mean:.2f} | {s.sync_share:.0%} | {p.trajectory_mb_per_s:,.1f}"
            f"{' (over)' if p.redis_saturated else ''} | {p.redis_memory_mb:,.0f} |"
        )
    return "\n".join(lines)


def sweep_plot(rows: list[Projection], path: Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for eta in sorted({p.max_staleness for p in rows}):
        pts = sorted((p.rollout_gpus / p.learner_gpus, p.sim.samples_per_s) for p in rows if p.max_staleness == eta)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"max_staleness {eta}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rollout GPUs : learner GPUs (log scale)")
    ax.set_ylabel("samples/s (simulated)")
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
