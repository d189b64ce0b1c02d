"""``bench/learner.py --quick`` runs and prints its ratio (timing is never asserted)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_bench_quick_reports_three_layout_figures(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    results = tmp_path / "figures.jsonl"
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "learner.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TETHER_BENCH_RESULTS": str(results)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"FIGURE learner/packed_vs_padded_dynamic: \d+\.\d+", proc.stdout)
    figures = {f["name"]: f for f in map(json.loads, results.read_text().splitlines())}
    assert set(figures) == {
        "learner/packed_vs_padded_dynamic",
        "learner/padded_dynamic_vs_padded_fixed",
        "learner/packed_vs_padded_fixed",
    }
    for f in figures.values():
        assert f["ratio"] > 0 and f["spread"][0] <= f["ratio"] <= f["spread"][1] and f["repeats"] >= 3


def test_mfu_bench_quick_runs_on_cpu_and_refuses_a_full_run_without_a_gpu(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    script = str(root / "bench" / "learner_mfu.py")
    out = tmp_path / "mfu.json"
    proc = subprocess.run([sys.executable, script, "--quick", "--json", str(out)], capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"tokens/s: median \d+", proc.stdout)

    figures = json.loads(out.read_text())
    assert figures["tokens_per_s_median"] > 0 and figures["mfu"] is None  # no MFU claim on a CPU
    lo, mid, hi = (figures[f"cudnn_sdpa_off_vs_on_{k}"] for k in ("min", "median", "max"))
    assert 0 < lo <= mid <= hi  # each step paired with one without cuDNN's sdpa (a no-op on the CPU)
    import torch

    if not torch.cuda.is_available():
        full = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
        assert full.returncode == 2 and "needs a CUDA GPU" in full.stdout
