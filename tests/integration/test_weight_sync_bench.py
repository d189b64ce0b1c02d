"""The weight-sync benchmark runs end to end (tiny model) and prints its ratios; timing is never asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
BENCH = Path(__file__).resolve().parents[2] / "bench" / "weight_sync.py"


def test_bench_quick_prints_ratios() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("receivers"))
    assert "vs raw" in header and "vs per-tensor" in header
    rows = [line.split() for line in lines[lines.index(header) + 1 :] if line.strip()]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(float(value) > 0 for row in rows for value in row[1:8])
