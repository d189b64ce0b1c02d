"""``bench/learning.py --quick`` runs every mode for every seed and prints its table and plot (timing is
never asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_learning_bench_quick_prints_the_table(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    png = tmp_path / "learning.png"
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "learning.py"), "--quick", "--seeds", "2", "--png", str(png)],
        capture_output=True, text=True, timeout=900, cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    # the modes alternate their order from seed to seed
    order = re.findall(r"seed (\d): max_staleness=(\d)", out)
    assert order == [("0", "0"), ("0", "1"), ("1", "1"), ("1", "0")]
    # accuracy per evaluated step (before training, every 2 steps) as mean±std for both modes
    for step in (0, 2, 4):
        cell = r"\d\.\d{3}±\d\.\d{3} @\d+s"
        assert re.search(rf"^\s+{step}\s+{cell}\s+{cell}$", out, re.M), out
    assert re.search(r"^sync \(0\)\s+\d\.\d{3}±\d\.\d{3}\s+\d+±\d+\s+[\d.]+±[\d.]+\s+1\.00±0\.00", out, re.M), out
    assert re.search(r"^async \(1\)\s+\d\.\d{3}±\d\.\d{3}\s+\d+±\d+\s+[\d.]+±[\d.]+\s+\d+\.\d{2}±\d+\.\d{2}", out, re.M)
    assert png.read_bytes()[:4] == b"\x89PNG"
