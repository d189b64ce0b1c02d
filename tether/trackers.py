"""Experiment trackers: where learner rank 0 sends each step's metrics besides ``metrics.jsonl``.

``run.loggers`` names them as verl's ``trainer.logger`` does: ``console`` (one ``step:N - key:value - ...``
line per step on the learner's stdout), ``tensorboard`` (``{run}/tensorboard``), ``wandb``, ``mlflow`` and
``trackio``. Each receives the run's resolved config when it starts and every step's metrics under verl's
names (:mod:`tether.verl_names`), and keeps its files in the run folder unless the user points it
elsewhere with the library's own environment variable:

- W&B: offline (``WANDB_MODE=online`` uploads), under ``{run}/wandb`` (``WANDB_DIR``); ``wandb sync`` later.
- MLflow: a file store ``file:{run}/mlruns`` (``MLFLOW_TRACKING_URI`` for a server or a database).
- trackio: ``{run}/trackio`` (``TRACKIO_DIR``); ``trackio show`` serves it.

A resumed run (``tether up --resume``) continues the same W&B and MLflow runs: their ids are kept in
``{run}/trackers.json``; trackio continues the run of the same name. A tracker whose package is missing is
an error at start that names the extra to install (``pip install 'tether[wandb]'``); a tracker that fails
later is dropped with one warning (:class:`tether.metrics.MultiMetrics`): logging never stops training.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from tether.logs import get_logger
from tether.metrics import JsonlMetrics, MetricsLogger, MultiMetrics, to_float
from tether.verl_names import to_verl_names

log = get_logger(__name__)

STEP_KEY = "training/global_step"
"""W&B's x-axis: the learner step, logged with every row (verl's name). W&B drops a row whose native step is
below the last one, and evaluation results arrive after later training steps; a step metric keeps them."""

IDS_FILE = "trackers.json"


class TrackerUnavailable(RuntimeError):
    """A tracker in ``run.loggers`` whose package is not installed."""


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker is started with: the run folder, the project (verl's ``trainer.project_name``), the run's
    name (its ``run_id``) and its resolved config as plain data."""

    root: Path
    project: str
    name: str
    config: Mapping[str, Any] = field(default_factory=dict)


class Tracker(MetricsLogger):
    """A tracker: gets finite numbers under verl's names; subclasses write them in :meth:`write`."""

    module: ClassVar[str | None] = None
    """The package it imports (None: nothing beyond tether's own dependencies)."""
    install: ClassVar[str] = ""
    """What ``pip install`` brings that package."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        numbers = {k: v for k, v in ((k, to_float(v)) for k, v in to_verl_names(metrics).items()) if v is not None}
        if numbers:
            self.write(numbers, int(step))

    def write(self, numbers: dict[str, float], step: int) -> None:
        raise NotImplementedError


class ConsoleTracker(Tracker):
    """verl's console logger: ``step:3 - actor/pg_loss:0.0123 - ...`` on stdout (``logs/learner.out`` under
    ``tether up``). ``tether up``'s terminal lines and the learner's progress bar do not depend on it."""

    def __init__(self, run: TrackerRun) -> None:
        pass

    def write(self, numbers: dict[str, float], step: int) -> None:
        print(" - ".join([f"step:{step}", *(f"{k}:{v:.6g}" for k, v in numbers.items())]), flush=True)


class TensorBoardTracker(Tracker):
    module, install = "tensorboard", "tensorboard"

    def __init__(self, run: TrackerRun) -> None:
        from torch.utils.tensorboard import SummaryWriter  # torch only where metrics are written

        self._writer = SummaryWriter(log_dir=str(run.root / "tensorboard"))

    def write(self, numbers: dict[str, float], step: int) -> None:
        for key, value in numbers.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker(Tracker):
    module, install = "wandb", "'tether[wandb]'"

    def __init__(self, run: TrackerRun) -> None:
        import wandb

        run_id = saved_id(run.root, "wandb") or secrets.token_hex(4)
        self._run = wandb.init(
            project=run.project,
            name=run.name,
            id=run_id,
            resume="allow",
            config=dict(run.config),
            # The library's own variables win: WANDB_MODE=online uploads, WANDB_DIR moves the files.
            mode=None if os.environ.get("WANDB_MODE") else "offline",
            dir=None if os.environ.get("WANDB_DIR") else str(run.root),
            settings=wandb.Settings(console="off"),  # the run's logs already live in {run}/logs
        )
        save_id(run.root, "wandb", run_id)
        self._run.define_metric(STEP_KEY)
        self._run.define_metric("*", step_metric=STEP_KEY)

    def write(self, numbers: dict[str, float], step: int) -> None:
        self._run.log({**numbers, STEP_KEY: step})

    def close(self) -> None:
        self._run.finish()


class MlflowTracker(Tracker):
    module, install = "mlflow", "'tether[mlflow]'"

    def __init__(self, run: TrackerRun) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run.root / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow 3 keeps its file store in maintenance mode behind this switch; a local folder per run
            # needs no database or server (``mlflow migrate-filestore`` moves it to one later).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=uri)
        self.run_id = saved_id(run.root, "mlflow")
        if self.run_id is not None:
            try:
                client.update_run(self.run_id, status="RUNNING")  # a resumed run continues its own curves
            except MlflowException:
                self.run_id = None
        if self.run_id is None:
            experiment = client.get_experiment_by_name(run.project)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(run.project)
            self.run_id = client.create_run(experiment_id, run_name=run.name).info.run_id
            save_id(run.root, "mlflow", self.run_id)
            self._log_params(mlflow_params(run.config))

    def _log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=items[i : i + 100])

    def write(self, numbers: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(mlflow_key(k), v, now, step) for k, v in numbers.items()]
        for i in range(0, len(items), 1000):  # and at most 1000 metrics
            self._client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


class TrackioTracker(Tracker):
    module, install = "trackio", "'tether[trackio]'"

    def __init__(self, run: TrackerRun) -> None:
        folder = str(run.root / "trackio")
        if "trackio" not in sys.modules:
            os.environ.setdefault("TRACKIO_DIR", folder)  # trackio reads it once, when imported
        import trackio
        from trackio.utils import TRACKIO_DIR

        if Path(TRACKIO_DIR) != Path(os.environ.get("TRACKIO_DIR", folder)):
            log.warning("trackio_dir_fixed_at_import", writes_to=str(TRACKIO_DIR), wanted=folder)
        self._run = trackio.init(project=run.project, name=run.name, config=dict(run.config), resume="allow",
                                 embed=False)  # fmt: skip

    def write(self, numbers: dict[str, float], step: int) -> None:
        self._run.log(numbers, step=step)

    def close(self) -> None:
        self._run.finish()


TRACKERS: dict[str, type[Tracker]] = {
    "console": ConsoleTracker,
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
    "trackio": TrackioTracker,
}
"""``run.loggers`` name → tracker. A new one is a class above and a line here (and its name in
:data:`tether.config.run.LoggerName`)."""


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(names: Iterable[str]) -> None:
    """Raise :class:`TrackerUnavailable` naming what to install for each tracker whose package is missing;
    cheap (nothing is imported), so every rank and a launcher can call it before starting anything."""
    missing = [(n, TRACKERS[n]) for n in names if TRACKERS[n].module and not _installed(TRACKERS[n].module)]
    if missing:
        raise TrackerUnavailable("; ".join(
            f"run.loggers: {n!r} needs the {t.module} package, which is not installed: pip install {t.install}"
            for n, t in missing
        ))  # fmt: skip


def start_trackers(names: Sequence[str], run: TrackerRun) -> list[Tracker]:
    """Each named tracker, started with the run's config less its secrets (:func:`shareable`). A missing
    package raises (:func:`check_installed`); any other failure to start is a warning and the run goes on
    without that tracker."""
    check_installed(names)
    run = replace(run, config=shareable(run.config))
    out: list[Tracker] = []
    for name in dict.fromkeys(names):
        try:
            out.append(TRACKERS[name](run))
        except ImportError as e:  # present but broken: the same advice as when absent
            tracker = TRACKERS[name]
            raise TrackerUnavailable(f"run.loggers: {name!r} cannot import {tracker.module} ({e}): "
                                     f"pip install {tracker.install}") from e  # fmt: skip
        except Exception as e:
            log.warning("tracker_unavailable", tracker=name, error=repr(e))
    return out


def shareable(config: Any, key: str = "") -> Any:
    """``config`` as a tracker may keep it (W&B online uploads it): bearer tokens (``rollout.auth_token``,
    ``rollout.reward.token``) and the password of a URL (``buffer.redis_url``) become ``***``."""
    if isinstance(config, Mapping):
        return {k: shareable(v, str(k)) for k, v in config.items()}
    if isinstance(config, list | tuple):
        return [shareable(v) for v in config]
    if isinstance(config, str) and config:
        if key.endswith("token"):
            return "***"
        return re.sub(r"(://[^/@\s:]*:)[^/@\s]+@", r"\1***@", config)
    return config


def saved_id(root: Path, tracker: str) -> str | None:
    """The id a tracker's run got when this run folder first started it (None the first time)."""
    try:
        value = json.loads((root / IDS_FILE).read_text()).get(tracker)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def save_id(root: Path, tracker: str, run_id: str) -> None:
    path = root / IDS_FILE
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError):
        ids = {}
    ids = {**(ids if isinstance(ids, dict) else {}), tracker: run_id}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(ids, indent=1) + "\n")
    tmp.replace(path)


def mlflow_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config flattened as verl gives it to MLflow: nested keys joined by ``/``, a list as ``list_len``
    and one key per index; values as text (at most MLflow's 6000 characters)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, list | tuple):
            value = {"list_len": len(value), **{str(i): v for i, v in enumerate(value)}}
        if isinstance(value, Mapping) and value:
            out.update(mlflow_params(value, prefix=f"{name}/"))
        else:
            out[mlflow_key(name)] = str(value)[:6000]
    return out


def mlflow_key(key: str) -> str:
    """A key MLflow accepts, as verl writes it: ``@`` → ``_at_``, runs of ``/`` → one, other characters
    outside ``[/\\w.\\- :]`` → ``_`` (``val/pass@k`` → ``val/pass_at_k``)."""
    key = re.sub(r"/+", "/", key.replace("@", "_at_"))
    return re.sub(r"[^/\w.\- :]", "_", key)


DEFAULT_LOGGERS = ("console", "tensorboard")


def build_metrics(
    run_root: str | Path,
    *,
    rank: int = 0,
    loggers: Sequence[str] = DEFAULT_LOGGERS,
    project: str = "tether",
    run_name: str | None = None,
    config: Mapping[str, Any] | None = None,
) -> MetricsLogger:
    """Rank 0: ``{run_root}/metrics.jsonl`` and each tracker of ``loggers`` (started with ``config``, the run's
    resolved config as plain data, under ``project`` and ``run_name``, default the folder's name); a no-op on
    other ranks. Every rank first checks the trackers' packages, so a missing one stops all ranks at once
    with what to install (:class:`tether.trackers.TrackerUnavailable`). (The old ``run.tensorboard`` switch
    is mapped onto ``run.loggers`` by the config.)"""
    names = list(loggers)
    check_installed(names)
    if rank != 0:
        return MetricsLogger()
    root = Path(run_root)
    sinks: list[MetricsLogger] = [JsonlMetrics(root / "metrics.jsonl")]
    sinks += start_trackers(names, TrackerRun(root, project=project, name=run_name or root.name, config=config or {}))
    return MultiMetrics(sinks)
