"""The run folder: one place per run for config, logs, metrics, checkpoints and snapshots.

runs/<run_id>/
  config.yaml          resolved config (what actually ran)
  logs/<process>.log   JSON lines, one file per process (learner-rank0, rollout-0, redis, ...)
  metrics.jsonl        one JSON object per logged step
  groups.jsonl         per trained group: server, generation start/end, lengths (for `tether plan`)
  tensorboard/         TensorBoard event files
  plots/               PNG curves (reward, loss, ...)
  checkpoints/         torch.distributed.checkpoint folders, step_<n>/
  snapshots/           safetensors weight snapshots for the filesystem transport
  spans/               <process>.jsonl: stage spans on the wall clock (`tether trace` merges them),
                       <process>.open.json: the spans open now (the watchdog reads them)
  redis/               the embedded Redis' working directory (its data, and ``url`` while it runs)
  gave_up.txt          why a process gave up where a restart cannot help (a dataset that does not fit the
                       config, a run that cannot train): ``tether up`` ends the run with it instead of restarting
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path

from tether.config import TetherConfig


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def snapshots(self) -> Path:
        return self.root / "snapshots"

    @property
    def spans(self) -> Path:
        return self.root / "spans"

    @property
    def redis(self) -> Path:
        return self.root / "redis"

    @property
    def redis_url_file(self) -> Path:
        """The embedded Redis' URL while it runs (``tether status`` finds a run by its id through it)."""
        return self.redis / "url"

    @property
    def gave_up(self) -> Path:
        """One line: why a process of the run gave up (see :func:`give_up`)."""
        return self.root / "gave_up.txt"

    def log_file(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def console_file(self, process: str) -> Path:
        return self.logs / f"{process}.out"

    def make(self) -> RunPaths:
        for d in (self.root, self.logs, self.plots, self.checkpoints):
            d.mkdir(parents=True, exist_ok=True)
        return self


def give_up(paths: RunPaths, reason: str) -> None:
    """Record that a process of the run stopped for ``reason`` and that starting it again cannot help (best
    effort: the process exits non-zero either way)."""
    try:
        paths.root.mkdir(parents=True, exist_ok=True)
        paths.gave_up.write_text(" ".join(reason.split()) + "\n")
    except OSError:
        pass


def gave_up(paths: RunPaths) -> str | None:
    """The reason :func:`give_up` recorded, or None."""
    try:
        return paths.gave_up.read_text().strip() or None
    except OSError:
        return None


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def run_paths(cfg: TetherConfig) -> RunPaths:
    if cfg.run.run_id is None:
        raise ValueError("run.run_id is empty; set it (all processes of one run must share it)")
    return RunPaths(Path(cfg.run.output_dir) / cfg.run.run_id)
