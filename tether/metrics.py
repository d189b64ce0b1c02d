"""One metrics interface for every process: ``logger.log({"loss/pg": 0.1}, step=3)``.

Sinks: JSON lines (always, the machine-readable record of a run, under tether's names) and the experiment
trackers of ``run.loggers`` (console, TensorBoard, W&B, MLflow, trackio: :mod:`tether.trackers`, under
verl's names). The default :class:`MetricsLogger` does nothing, so library code can log unconditionally;
only rank 0 gets real sinks. A failing sink logs one warning and is switched off: logging never crashes
training. Key names are ``area/name``: ``loss/pg``, ``rollout/tokens_per_s``, ``buffer/staleness_max``.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tether.logs import get_logger

log = get_logger(__name__)


def to_float(value: Any) -> float | None:
    """A finite float, or None (non-numbers and NaN/inf)."""
    try:
        out = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


class MetricsLogger:
    """The no-op default."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record ``metrics`` (numbers, 0-d tensors or arrays) at ``step``."""

    def close(self) -> None:
        """Flush and release files."""


class JsonlMetrics(MetricsLogger):
    """Appends ``{"step": s, "time": t, key: value, ...}`` per call; non-finite values become null."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        row: dict[str, Any] = {"step": int(step), "time": time.time()}
        row.update({k: to_float(v) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class MultiMetrics(MetricsLogger):
    """Fans out to several sinks; a sink that raises is dropped after one warning."""

    def __init__(self, sinks: list[MetricsLogger]) -> None:
        self.sinks = list(sinks)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(metrics, step)
            except Exception as e:
                log.warning("metrics_sink_disabled", sink=type(sink).__name__, error=repr(e))
                self.sinks.remove(sink)

    def close(self) -> None:
        for sink in self.sinks:
            with contextlib.suppress(Exception):
                sink.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl file; a torn last line (a crash mid-write) is skipped."""
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
