"""``bench/learner.py --quick`` runs and prints its ratio (timing is never asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_bench_quick_prints_a_ratio() -> None:
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "learner.py"), "--quick"], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"packed/padded tokens/s ratio: \d+\.\d+x", proc.stdout)
