"""The weight-sync benchmark runs end to end (tiny model) and reports its figures; timing is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
BENCH = Path(__file__).resolve().parents[2] / "bench" / "weight_sync.py"


def test_bench_quick_reports_figures_against_raw_and_per_param(tmp_path: Path) -> None:
    results = tmp_path / "figures.jsonl"
    env = {**os.environ, "TETHER_BENCH_RESULTS": str(results)}
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=380, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = {f["name"]: f for f in map(json.loads, results.read_text().splitlines())}
    assert set(figures) == {
        f"weight_sync/{what}_{n}recv"
        for what in ("update_vs_raw", "update_vs_per_param", "transfer_vs_raw", "update_vs_whole_buckets")
        for n in (1, 2)
    }
    for f in figures.values():
        assert f["ratio"] > 0 and f["spread"][0] <= f["ratio"] <= f["spread"][1] and f["repeats"] >= 3
        assert f"FIGURE {f['name']}:" in proc.stdout
    assert "no barrier" in figures["weight_sync/update_vs_per_param_1recv"]["baseline"]
    assert "direct_tensor_mb: 0" in figures["weight_sync/update_vs_whole_buckets_1recv"]["baseline"]
