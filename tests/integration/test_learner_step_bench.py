"""The lean-step benchmark runs end to end (demo model, a standalone receiver) and reports its figures;
timing is never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]
BENCH = Path(__file__).resolve().parents[2] / "bench" / "learner_step.py"


def test_bench_quick_reports_each_lever_against_the_step_without_it(tmp_path: Path) -> None:
    results = tmp_path / "figures.jsonl"
    env = {**os.environ, "TETHER_BENCH_RESULTS": str(results), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=380, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = {f["name"]: f for f in map(json.loads, results.read_text().splitlines())}
    assert set(figures) == {
        "learner_step/step_vs_all_off",
        "learner_step/optimizer_vs_loop",
        "learner_step/optimizer_vs_local_adamw_off",
        "learner_step/train_vs_local_adamw_off",
        "learner_step/critical_publish_vs_background_off",
        "learner_step/critical_publish_vs_local_shard_off",
        "learner_step/train_vs_local_clip_off",
    }
    for f in figures.values():
        assert f["ratio"] > 0 and f["spread"][0] <= f["ratio"] <= f["spread"][1] and f["repeats"] >= 3
        assert f"FIGURE {f['name']}:" in proc.stdout
