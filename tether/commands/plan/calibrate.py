"""``tether plan --from-run runs/<id>``: replay a finished run in the simulator and compare.

What is taken from the run, each from the side that produced it, so that throughput, idle time and
staleness come out of the simulated protocol and are not fitted to the figures they are compared with:

* the knobs: ``config.yaml`` (B, n, max_staleness, sync_every, servers, prompt workers, inflight);
* rollout: ``groups.jsonl`` (:mod:`learner.group_trace`) — each server's completion tokens over its busy
  time (the union of its groups' generation intervals) is its decode rate; the groups' completion
  lengths are the length distribution (whole groups resampled); the lag from a group's last token to
* learner: ``metrics.jsonl`` — per step, the time neither waiting for data nor in weight sync (resampled),
  and ``timing/weight_sync`` (resampled); with ``groups.jsonl``, the part of each ``timing/wait_data``
  that generation still running does not explain (reading, decoding, the server's scoring and write):
  its median is charged to every simulated step as reading time.

The measured figures use the same window as the simulation: the steps after the first (which holds the
rollout servers' start-up). samples/s = trained samples over the wall time between the first step's
metrics line and the last one; idle = the summed ``timing/wait_data`` over that time.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from tether.commands.plan.fleet import FleetSpec, Lengths
from tether.commands.plan.sim import SimResult, simulate_mean
from tether.config import ConfigError, TetherConfig, load_config
from tether.metrics import read_metrics
from tether.resources import prompt_workers

WARMUP = 1
SIMULATED_GROUPS = 6000


@dataclass(frozen=True)
class Measured:
    samples_per_s: float
    learner_idle: float
    sync_share: float
    staleness: dict[int, int]
    steps: int

    @property
    def staleness_mean(self) -> float:
        total = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / total if total else 0.0


@dataclass(frozen=True)
class Calibration:
    fleet: FleetSpec
    measured: Measured
    predicted: SimResult
    rollout_tokens_per_s: list[float]
    """Each server's decode rate as measured from its groups."""


def _busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return total + ((cur_e - cur_s) if cur_e is not None else 0.0)


def read_run(folder: str | Path) -> tuple[FleetSpec, Measured, list[float]]:
    folder = Path(folder)
    cfg, rows, groups = _read_files(folder)
    steps = sorted(rows)
    if len(steps) < WARMUP + 3 or steps != list(range(1, len(steps) + 1)):
        raise ConfigError(
            f"--from-run {folder}: needs one unbroken lifetime of at least {WARMUP + 3} steps "
            f"(found steps {steps[:3]}…{steps[-3:]}); a resumed run cannot be replayed"
        )
    timed = [g for g in groups if g.get("started") and g.get("finished")]
    if not timed:
        raise ConfigError(f"--from-run {folder}: groups.jsonl has no generation timestamps")

    rates = _server_rates(timed)
    window = steps[WARMUP:]
    learner_busy = [
        rows[k]["timing/step"] - rows[k]["timing/wait_data"] - rows[k]["timing/weight_sync"] for k in window
    ]
    fleet = FleetSpec(
        train_batch_size=cfg.learner.train_batch_size,
        n=cfg.rollout.n,
        max_staleness=cfg.algorithm.max_staleness,
        stale_wait=cfg.algorithm.stale_wait_s > 0,
        sync_every=cfg.weight_sync.sync_every,
        servers=len(rates),
        slots_per_server=prompt_workers(cfg),
        server_tokens_per_s=statistics.fmean(rates),
        learner_step_s=statistics.median(learner_busy),
        learner_tokens_per_s=float("inf"),
        learner_step_samples=tuple(learner_busy),
        sync_s=statistics.median(rows[k]["timing/weight_sync"] for k in window),
        sync_samples=tuple(rows[k]["timing/weight_sync"] for k in window),
        read_s=_read_seconds(rows, timed, window),
        lengths=Lengths(
            groups=tuple(tuple(g["lengths"]) for g in groups if g["step"] > WARMUP)
            or (tuple(tuple(g["lengths"]) for g in groups))
        ),
        prompt_tokens=statistics.fmean(g["prompt"] for g in groups),
        inflight=cfg.weight_sync.inflight,
    )
    elapsed = rows[steps[-1]]["time"] - rows[steps[WARMUP - 1]]["time"]
    measured = Measured(
        samples_per_s=sum(rows[k]["learner/samples"] for k in window) / elapsed,
        learner_idle=sum(rows[k]["timing/wait_data"] for k in window) / elapsed,
        sync_share=sum(rows[k]["timing/weight_sync"] for k in window) / elapsed,
        staleness=dict(sorted(Counter(g["staleness"] for g in groups if g["step"] > WARMUP).items())),
        steps=len(steps),
    )
    return fleet, measured, rates


def _read_files(folder: Path) -> tuple[TetherConfig, dict[int, dict], list[dict]]:
    """The run's config, its learner steps' metrics rows by step, and its groups (``groups.jsonl``)."""
    for name in ("config.yaml", "metrics.jsonl", "groups.jsonl"):
        if not (folder / name).is_file():
            hint = (
                " (written by the learner since `tether plan` exists; rerun with this version)"
                if name == ("groups.jsonl")
                else ""
            )
            raise ConfigError(f"--from-run {folder}: no {name} in it{hint}")
    cfg = load_config(folder / "config.yaml")
    rows = {r["step"]: r for r in read_metrics(folder / "metrics.jsonl") if "timing/step" in r}
    groups = [json.loads(line) for line in (folder / "groups.jsonl").read_text().splitlines() if line.strip()]
    return cfg, rows, groups


def _server_rates(timed: list[dict]) -> list[float]:
    """Each server's decode rate: its completion tokens over its busy time (the union of its groups' generation
    intervals)."""
    by_server: dict[str, list[dict]] = defaultdict(list)
    for g in timed:
        by_server[g["server"]].append(g)
    return [
        sum(sum(g["lengths"]) for g in gs) / max(1e-9, _busy_seconds([(g["started"], g["finished"]) for g in gs]))
        for gs in by_server.values()
    ]


def _read_seconds(rows: dict[int, dict], timed: list[dict], window: list[int]) -> float:
    """The part of each step's wait that generation does not explain: the batch's last group finished at
    `last`, the step began when the previous one logged; what the learner waited beyond that is reading,
    decoding and the server's scoring and write. Its median is charged to every step as reading time."""
    unexplained = []
    for k in window:
        start = rows[k - 1]["time"]
        last = max((g["finished"] for g in timed if g["step"] == k), default=start)
        unexplained.append(max(0.0, rows[k]["timing/wait_data"] - max(0.0, last - start)))
    return statistics.median(unexplained)


def calibrate(folder: str | Path, *, seeds: int = 5) -> Calibration:
    fleet, measured, rates = read_run(folder)
    # A long run is replayed for as many steps as give a steady rate (its figures are whole-run averages).
    steps = min(measured.steps, WARMUP + max(30, SIMULATED_GROUPS // fleet.train_batch_size))
    predicted = simulate_mean(fleet, steps=steps, warmup=WARMUP, seeds=seeds)
    return Calibration(fleet=fleet, measured=measured, predicted=predicted, rollout_tokens_per_s=rates)


def report(cal: Calibration) -> str:
    m, p, f = cal.measured, cal.predicted, cal.fleet

    def hist(h: dict[int, int]) -> str:
        total = sum(h.values()) or 1
        return "  ".join(f"{k}: {v / total:.0%}" for k, v in sorted(h.items()))

    rel = p.samples_per_s / m.samples_per_s - 1 if m.samples_per_s else float("nan")
    lines = [
        f"inputs: B={f.train_batch_size} n={f.n} max_staleness={f.max_staleness} sync_every={f.sync_every} "
        f"servers={f.servers}×{f.slots_per_server} slots inflight={f.inflight}",
        f"  rollout {', '.join(f'{r:.0f}' for r in cal.rollout_tokens_per_s)} tokens/s per server (busy time), "
        f"{len(f.lengths.groups)} groups of lengths",
        f"  learner {statistics.median(f.learner_step_samples) * 1e3:.0f} ms per step (median of "
        f"{len(f.learner_step_samples)}), read {f.read_s * 1e3:.1f} ms, weight sync {f.sync_s * 1e3:.0f} ms (median)",
        f"{'':<22}{'measured':>10}{'predicted':>11}",
        f"{'samples/s':<22}{m.samples_per_s:>10.1f}{p.samples_per_s:>11.1f}   ({rel:+.0%})",
        f"{'learner idle':<22}{m.learner_idle:>10.1%}{p.learner_idle:>11.1%}",
        f"{'weight-sync share':<22}{m.sync_share:>10.1%}{p.sync_share:>11.1%}",
        f"{'staleness mean':<22}{m.staleness_mean:>10.2f}{p.staleness_mean:>11.2f}",
        f"staleness measured   {hist(m.staleness)}",
        f"staleness predicted  {hist(p.staleness)}",
        f"(steps {WARMUP + 1}–{m.steps} of the run; prediction: mean of the simulation over independent seeds)",
    ]
    return "\n".join(lines)
