"""Metrics: JSONL rows, sinks that fail are dropped (never crash training), curves plotted to PNG."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tether.metrics import JsonlMetrics, MetricsLogger, MultiMetrics, read_metrics
from tether.plots import plot_metrics
from tether.trackers import build_metrics


def test_jsonl_rows_and_non_finite(tmp_path: Path) -> None:
    sink = JsonlMetrics(tmp_path / "m.jsonl")
    sink.log({"loss/pg": 0.5, "reward/mean": float("nan")}, step=1)
    sink.log({"loss/pg": 0.25}, step=2)
    sink.close()
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss/pg"] == 0.5 and rows[0]["reward/mean"] is None
    assert rows[1]["loss/pg"] == 0.25


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')
    assert read_metrics(path) == [{"step": 1, "x": 1.0}]


class Broken(MetricsLogger):
    calls = 0

    def log(self, metrics, step):
        Broken.calls += 1
        raise OSError("disk full")


def test_broken_sink_never_raises(tmp_path: Path) -> None:
    good = JsonlMetrics(tmp_path / "m.jsonl")
    multi = MultiMetrics([Broken(), good])
    for step in range(3):
        multi.log({"x": step}, step=step)
    assert Broken.calls == 1  # dropped after the first failure
    assert [r["x"] for r in read_metrics(tmp_path / "m.jsonl")] == [0, 1, 2]


def test_only_rank0_writes(tmp_path: Path) -> None:
    build_metrics(tmp_path / "r1", rank=1).log({"x": 1}, step=0)
    assert not (tmp_path / "r1" / "metrics.jsonl").exists()
    m = build_metrics(tmp_path / "r0", rank=0, loggers=["tensorboard"])
    m.log({"x": 1}, step=0)
    m.close()
    assert read_metrics(tmp_path / "r0" / "metrics.jsonl")[0]["x"] == 1
    assert any((tmp_path / "r0" / "tensorboard").iterdir())


def test_plot_writes_png(tmp_path: Path) -> None:
    sink = JsonlMetrics(tmp_path / "m.jsonl")
    for step in range(20):
        sink.log({"reward/mean": step / 20, "loss/total": math.exp(-step / 5)}, step=step)
    sink.close()
    out = plot_metrics(tmp_path / "m.jsonl", tmp_path / "plots" / "curves.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    JsonlMetrics(tmp_path / "other.jsonl").log({"unplotted/key": 1.0}, step=0)
    assert plot_metrics(tmp_path / "other.jsonl", tmp_path / "none.png") is None


@pytest.mark.parametrize("value", [1, 2.5, True])
def test_numbers_of_any_kind(tmp_path: Path, value: object) -> None:
    sink = JsonlMetrics(tmp_path / "m.jsonl")
    sink.log({"v": value}, step=0)
    sink.close()
    assert read_metrics(tmp_path / "m.jsonl")[0]["v"] == float(value)
