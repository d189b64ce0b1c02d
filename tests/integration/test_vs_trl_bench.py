"""``bench/vs_trl.py --quick`` runs TRL and both tether modes and prints ratios and reward curves.

Only where TRL is installed (the ``bench`` extra); timing is never asserted.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("trl") is None, reason="TRL is not installed (pip install -e .[bench])"
    ),
]


def test_vs_trl_quick(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "vs_trl.json"
    proc = subprocess.run([sys.executable, str(root / "bench" / "vs_trl.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("TRL GRPOTrainer", "tether max_staleness 1", "tether max_staleness 0", "samples/s vs TRL"):
        assert name in proc.stdout
    result = json.loads(out.read_text())["64x2"]
    for system in ("trl", "async", "sync"):
        assert len(result["s_per_step"][system]) == 1 and result["s_per_step"][system][0] > 0
        assert len(result[f"reward_{system}"]) == 6  # one mean reward per step
        assert all(0.0 <= r <= 1.0 for r in result[f"reward_{system}"])
        assert len(result[f"final_reward_{system}"]) == 1 and 0.0 <= result[f"final_reward_{system}"][0] <= 1.0
    assert result["ratio_trl"] == [1.0]
