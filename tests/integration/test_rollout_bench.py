"""``bench/rollout.py --quick`` runs and reports engine vs ``model.generate`` and one gRPC figure per concurrency
(timings are never asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_rollout_bench_quick_reports_ratios(tmp_path: Path) -> None:
    results = tmp_path / "figures.jsonl"
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "rollout.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
        env={**os.environ, "TETHER_BENCH_RESULTS": str(results)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ratio gRPC/in-process" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("|") and line.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [1, 8, 64]
    # What the engine ran on each side (in-process: the engine's counts; gRPC: scraped from the server's metrics).
    shapes = [line for line in out.stdout.splitlines() if "rows/decode pass" in line]
    assert len(shapes) == 6 and not any(" 0.0 rows/decode pass" in line for line in shapes)
    figures = [json.loads(line) for line in results.read_text().splitlines()]
    assert [f["name"] for f in figures] == [
        "rollout/engine_vs_generate",
        *(f"rollout/grpc_vs_inprocess_{c}clients" for c in (1, 8, 64)),
    ]
    for f in figures:
        assert f["ratio"] > 0 and f["spread"][0] <= f["ratio"] <= f["spread"][1] and f["repeats"] >= 3
        assert f["goal"] == (1.0 if f["name"] == "rollout/engine_vs_generate" else 0.95) and f["direction"] == "min"
        assert f["quick"] is True
