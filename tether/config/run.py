"""``run``: identity of a run and where its files go."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from tether.config.base import Section


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

    tensorboard: bool = True
    """Also write metrics as TensorBoard event files (``{run}/tensorboard``); JSONL is always written."""

    max_restarts: int = Field(default=3, ge=0)
    """``tether up``: how often a child that dies is started again before the run gives up — a rollout server
    as it was (it rejoins at the current version), the learner with ``--resume`` (from its last checkpoint).
    0: any child's death ends the run."""

    restart_backoff_s: float = Field(default=2.0, gt=0)
    """``tether up``: wait before the first restart of a child; doubled for each further one (at most 60 s)."""

    @field_validator("run_id")
    @classmethod
    def _safe_run_id(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", v):
            raise ValueError("must be 1-128 characters of letters, digits, '.', '_' or '-'")
        return v
