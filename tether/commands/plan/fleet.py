"""What the simulator is told: the protocol's knobs and the rate of each component.

:class:`FleetSpec` is everything :mod:`tether.commands.plan.sim` needs, whether it came from a finished run
(:mod:`tether.commands.plan.calibrate`) or from a rates file and a GPU split
(:mod:`tether.commands.plan.rates`). The knobs keep tether's config names (``train_batch_size``, ``n``,
``max_staleness``, ``sync_every``, ``inflight``);
the rates are the three a user can measure on one machine: a rollout server's decode throughput, the
learner's time per step, and one weight update's time.

A rollout server is modelled as continuous batching: the groups it works on share its aggregate decode
rate ``server_tokens_per_s`` equally (processor sharing), and no group goes faster than
``seq_tokens_per_s`` per sequence, so a group alone still takes ``longest completion / seq_tokens_per_s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np


@dataclass(frozen=True)
class Lengths:
    """Completion lengths of one group's ``n`` samples: whole groups resampled from a run, or lognormal."""

    groups: tuple[tuple[int, ...], ...] = ()
    """Observed groups (each a tuple of completion lengths); when set, groups are drawn from these."""
    mean: float = 0.0
    cv: float = 0.0
    """Coefficient of variation of the lognormal (0: every completion is ``mean`` long)."""
    max_tokens: int = 0
    """Cap (``rollout.max_tokens``); 0: none."""

    def __post_init__(self) -> None:
        if not self.groups and self.mean <= 0:
            raise ValueError("lengths: give observed groups or a positive mean")
        if self.cv < 0:
            raise ValueError(f"lengths.cv must be >= 0, got {self.cv}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.groups:
            return np.asarray(self.groups[rng.integers(len(self.groups))], dtype=np.float64)
        if self.cv == 0:
            out = np.full(n, self.mean)
        else:
            sigma = math.sqrt(math.log1p(self.cv**2))
            out = rng.lognormal(math.log(self.mean) - sigma**2 / 2, sigma, n)
        if self.max_tokens:
            out = np.minimum(out, self.max_tokens)
        return np.maximum(np.round(out), 1.0)

    def mean_tokens(self) -> float:
        """Expected completion length per sample (for bandwidth and memory)."""
        if self.groups:
            return float(np.mean([x for g in self.groups for x in g]))
        if self.max_tokens and self.cv > 0:  # the cap's effect, estimated by sampling once
            return float(self.sample(np.random.default_rng(0), 20_000).mean())
        return min(self.mean, self.max_tokens) if self.max_tokens else self.mean


@dataclass(frozen=True)
class FleetSpec:
    """The fleet the simulator runs: the protocol's knobs, the rate of each component, the lengths drawn."""

    train_batch_size: int
    """B: groups per learner step (one prompt each)."""
    n: int
    """Samples per group."""
    max_staleness: int
    sync_every: int
    servers: int
    slots_per_server: int
    """Groups one server generates at once (``rollout.prompt_workers``)."""
    server_tokens_per_s: float
    """Aggregate completion tokens/s of one server while it has work."""
    learner_step_s: float
    """Learner time per step besides the tokens term (optimizer, collectives, bookkeeping)."""
    learner_tokens_per_s: float
    """Learner tokens (prompt + completion) per second of compute; ``inf``: the step time is fixed."""
    sync_s: float
    """One weight update, learner side (announce → transfer → load on every server)."""
    lengths: Lengths
    prompt_tokens: float = 0.0
    seq_tokens_per_s: float = math.inf
    """Per-sequence decode ceiling (single-stream speed)."""
    group_overhead_s: float = 0.0
    """After generation: scoring and the buffer write (the slot stays busy)."""
    inflight: Literal["keep", "drain"] = "keep"
    stale_wait: bool = True
    """The learner waits for groups about to pass ``max_staleness`` (``algorithm.stale_wait_s`` > 0)."""
    learner_step_samples: Sequence[float] = field(default=())
    """Observed learner step times (seconds) to resample instead of the linear model; from a run."""
    sync_samples: Sequence[float] = field(default=())
    """Observed weight-update times to resample instead of ``sync_s``; from a run."""
    read_s: float = 0.0
    """Learner time to read a batch that is already in the buffer (counted as waiting for data)."""

    def __post_init__(self) -> None:
        for name in ("train_batch_size", "n", "sync_every", "servers", "slots_per_server"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        for name in ("server_tokens_per_s", "learner_tokens_per_s", "seq_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("learner_step_s", "sync_s", "group_overhead_s", "prompt_tokens", "read_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.inflight not in ("keep", "drain"):
            raise ValueError(f"inflight must be 'keep' or 'drain', got {self.inflight!r}")

    @property
    def prompts_per_version(self) -> int:
        return self.train_batch_size * self.sync_every

    def learner_seconds(self, tokens: float, rng: np.random.Generator) -> float:
        if self.learner_step_samples:
            return float(self.learner_step_samples[rng.integers(len(self.learner_step_samples))])
        return self.learner_step_s + tokens / self.learner_tokens_per_s

    def sync_seconds(self, rng: np.random.Generator) -> float:
        if self.sync_samples:
            return float(self.sync_samples[rng.integers(len(self.sync_samples))])
        return self.sync_s
