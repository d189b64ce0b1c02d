"""``bench/rollout.py --quick`` runs and prints its ratio table (timings are never asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_rollout_bench_quick_prints_ratios() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "rollout.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ratio gRPC/in-process" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("|") and line.split("|")[1].strip().isdigit()]
    assert [int(r.split("|")[1]) for r in rows] == [1, 8, 64]
    assert all(float(r.split("|")[5]) > 0 for r in rows)
