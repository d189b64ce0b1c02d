"""``run``: identity of a run and where its files go."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator

from tether.config.base import Section

LoggerName = Literal["console", "tensorboard", "wandb", "mlflow", "trackio"]
"""A tracker of ``run.loggers`` (the registry is ``tether.trackers.TRACKERS``)."""


class RunConfig(Section):
    run_id: str | None = None
    """Name of the run; every Redis key lives under ``tether:{run_id}:`` and files under
    ``{output_dir}/{run_id}``. All processes of one run must share it. ``tether up`` makes one from
    the date when it is empty; processes launched separately require it."""

    output_dir: str = "runs"
    """Folder holding one sub-folder per run (config, logs, metrics, checkpoints, snapshots)."""

    seed: int = Field(default=0, ge=0)
    """Seed for Python, NumPy and torch on every process (ranks and servers offset it)."""

    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Minimum level of log lines."""

    log_format: Literal["console", "json"] = "console"
    """Format of log lines on the console; the per-process log files are always JSON lines."""

    loggers: list[LoggerName] = Field(default_factory=lambda: ["console", "tensorboard"])
    """Experiment trackers learner rank 0 sends each step's metrics to, verl's ``trainer.logger`` names:
    ``console`` (a ``step:N - key:value`` line per step on the learner's stdout, ``logs/learner.out`` under
    ``tether up``), ``tensorboard`` (``{run}/tensorboard``), ``wandb`` (offline, ``{run}/wandb``), ``mlflow``
    (``{run}/mlruns``), ``trackio`` (``{run}/trackio``). They get the resolved config and verl's curve names
    (docs/TRACKERS.md); ``metrics.jsonl`` is always written, with tether's names. ``wandb``, ``mlflow`` and
    ``trackio`` need the extra of that name (``pip install 'tether[wandb]'``)."""

    project_name: str = Field(default="tether", min_length=1)
    """The project trackers file the run under (W&B project, MLflow experiment, trackio project), verl's
    ``trainer.project_name``; the run itself is named by ``run_id``."""

    max_restarts: int = Field(default=3, ge=0)
    """``tether up``: how often a child that dies is started again before the run gives up — a rollout server
    as it was (it rejoins at the current version), the learner with ``--resume`` (from its last checkpoint).
    0: any child's death ends the run."""

    restart_backoff_s: float = Field(default=2.0, gt=0)
    """``tether up``: wait before the first restart of a child; doubled for each further one (at most 60 s)."""

    trace: bool = True
    """Every process records its stage spans (generation, reward calls, buffer put/get, weight sync stages,
    learner forward/backward/optimizer/publish) in ``{run}/spans``; ``tether trace`` merges them into one
    Chrome/Perfetto timeline, and the watchdog names the stage that is stuck from them. Measured overhead
    on the demo loop: ``bench/trace_overhead.py``."""

    watchdog_k: float = Field(default=5.0, gt=1)
    """``tether up`` / ``tether status``: no learner step for ``watchdog_k`` × the median of the recent step
    times (and at least ``watchdog_floor_s``) is a stall, and the console names the stage that is stuck and
    its process from the open spans (``tether/commands/watchdog.py``)."""

    watchdog_floor_s: float = Field(default=30.0, gt=0)
    """The least time without a learner step that counts as a stall (300 s before a lifetime's first step)."""

    @field_validator("loggers", mode="before")
    @classmethod
    def _one_logger(cls, v: Any) -> Any:
        return _as_list(v)

    @field_validator("loggers")
    @classmethod
    def _no_repeats(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @field_validator("run_id")
    @classmethod
    def _safe_run_id(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", v):
            raise ValueError("must be 1-128 characters of letters, digits, '.', '_' or '-'")
        return v


def _as_list(value: Any) -> Any:
    """verl accepts ``logger: console`` for ``[console]``; so does ``--run.loggers wandb``."""
    return [value] if isinstance(value, str) else value
