"""One way for every benchmark to state a figure: a ratio against a baseline, with its spread and goal.

A *figure* is the median over ``repeats`` of a ratio measured against a baseline in the same run, the
min–max of those repeats (with three repeats an inter-quartile range says nothing the min–max does
not), the goal and which way it points (``min``: the ratio must be at least the goal; ``max``: at
most), and in words what the baseline was. Each repeat pairs one measurement of the measured side with
one of the baseline taken right next to it, the order alternating from repeat to repeat
(:func:`ordered`), so that drift in the machine (other processes, thermal, caches) hits both alike; the
ratio is taken per pair and the median of those ratios is the figure.

:func:`report` prints one readable line per figure and, when ``TETHER_BENCH_RESULTS`` names a file,
appends the figure to it as a JSON line; ``bench/report.py`` turns that file into ``bench/results.json``
and ``bench/results.md``. Timings are never asserted anywhere: a test checks that a figure is
reported, not what it is.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, TypeVar

RESULTS_ENV = "TETHER_BENCH_RESULTS"
SPREAD = "min-max"
T = TypeVar("T")


@dataclass(frozen=True)
class Figure:
    """One published ratio; see the module docstring for what each field means."""

    name: str
    ratio: float
    spread: tuple[float, float]
    goal: float | None
    direction: Literal["min", "max"]
    baseline: str
    repeats: int
    spread_kind: str = SPREAD
    note: str = ""
    quick: bool = False
    """From a ``--quick`` smoke run: it shows the script works, it is not a measurement."""

    @property
    def met(self) -> bool | None:
        """Whether the median meets the goal (``None`` when the figure has no goal)."""
        if self.goal is None:
            return None
        return self.ratio >= self.goal if self.direction == "min" else self.ratio <= self.goal

    def line(self) -> str:
        lo, hi = self.spread
        goal = "no goal" if self.goal is None else f"goal {'>=' if self.direction == 'min' else '<='} {self.goal:g}"
        verdict = {True: "met", False: "NOT met", None: "-"}[self.met]
        return (
            f"FIGURE {self.name}: {self.ratio:.3f} ({self.spread_kind} {lo:.3f}-{hi:.3f}, {self.repeats} repeats)"
            f"  {goal}: {verdict}  vs {self.baseline}{'  [--quick: not a measurement]' if self.quick else ''}"
        )


def figure(
    name: str,
    ratios: Sequence[float],
    *,
    goal: float | None,
    direction: Literal["min", "max"],
    baseline: str,
    note: str = "",
) -> Figure:
    """The figure of per-repeat ``ratios``: their median, their min–max."""
    if not ratios:
        raise ValueError(f"{name}: no repeats to report")
    if direction not in ("min", "max"):
        raise ValueError(f"{name}: direction must be 'min' or 'max', not {direction!r}")
    values = [float(r) for r in ratios]
    return Figure(
        name=name,
        ratio=statistics.median(values),
        spread=(min(values), max(values)),
        goal=goal,
        direction=direction,
        baseline=baseline,
        repeats=len(values),
        note=note,
    )


def report(fig: Figure, *, quick: bool = False) -> Figure:
    """Print ``fig`` on one line; append it to ``$TETHER_BENCH_RESULTS`` as JSON when that is set.

    ``quick``: the figure comes from a ``--quick`` smoke run, and says so wherever it is shown."""
    if quick:
        fig = replace(fig, quick=True)
    print(fig.line(), flush=True)
    path = os.environ.get(RESULTS_ENV)
    if path:
        row = {
            **asdict(fig),
            "spread": list(fig.spread),
            "met": fig.met,
            "host": f"{platform.node()} ({os.cpu_count()} cpus, {platform.machine()})",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with Path(path).open("a") as f:
            f.write(json.dumps(row) + "\n")
    return fig


def tether_up(cfg: dict, *, out: Path, run_id: str, what: str = "") -> Path:
    """Run ``tether up`` on ``cfg`` (written to ``out/<run_id>.yaml``; an earlier run of that name is removed
    first) and return its run folder; a failed run ends the benchmark with its stderr's tail."""
    import shutil
    import subprocess
    import sys

    import yaml

    shutil.rmtree(out / run_id, ignore_errors=True)
    path = out / f"{run_id}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    result = subprocess.run([sys.executable, "-m", "tether", "up", "--config", str(path)],
                            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"tether up failed ({what or run_id}):\n{result.stderr[-3000:]}")
    return out / run_id


def ordered(items: Sequence[T], repeat: int) -> list[T]:
    """``items`` rotated by ``repeat``: with two sides, each runs first on every other repeat."""
    k = repeat % len(items)
    return [*items[k:], *items[:k]]
