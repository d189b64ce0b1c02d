"""``bench/load.py --quick`` runs, prints its table, and its backpressure phase is refused, not queued.

The refusal is a behaviour (32 clients against ``max_concurrent_requests`` 8 must see
RESOURCE_EXHAUSTED); the timings in the table are printed, never asserted.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_load_bench_quick() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--quick", "--seconds", "2"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {r.split("|")[1].strip(): r.split("|") for r in out.stdout.splitlines() if r.startswith("| ")}
    assert {"generate", "episode", "backpressure"} <= set(rows), out.stdout
    for name in ("generate", "episode"):
        assert int(rows[name][3]) > 0 and float(rows[name][6]) > 0, rows[name]  # calls made, some succeeded
    assert "RESOURCE_EXHAUSTED=" in rows["backpressure"][8]
    refused = int(re.search(r"backpressure: RESOURCE_EXHAUSTED=(\d+)", out.stdout).group(1))
    assert refused > 0, out.stdout
