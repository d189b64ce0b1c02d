"""``bench/length_bias.py --quick`` runs its three modes and reports every figure (values never asserted:
the mechanism is tests/integration/test_feed_stale_wait.py's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_length_bias_bench_quick_reports_its_figures(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    results = tmp_path / "figures.jsonl"
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "length_bias.py"), "--quick", "--out", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "TETHER_BENCH_RESULTS": str(results)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for mode in ("sync s0", "nowait s1", "wait s1"):
        assert mode in proc.stdout
    figures = {f["name"]: f for f in map(json.loads, results.read_text().splitlines())}
    assert set(figures) == {f"length_bias/{k}_s1" for k in ("tv_wait", "tv_nowait", "samples_per_s", "tokens_per_s",
                                                            "heldout")}  # fmt: skip
    assert all(f["quick"] for f in figures.values())
    books = json.loads((tmp_path / "runs" / "lb-wait-s1-seed0" / "buffer_stats.json").read_text())
    assert books["buffer/length_mean_generated"] > 0 and "buffer/length_tv" in books
