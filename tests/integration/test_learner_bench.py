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
    """The matrix's script on a small shape: each row appended as it ends, both MFU formulas' keys (None on
    a CPU: no claim), the baseline again last; a full run refuses without a GPU."""
    root = Path(__file__).resolve().parents[2]
    script = str(root / "bench" / "learner_mfu.py")
    out = tmp_path / "mfu.jsonl"
    proc = subprocess.run([sys.executable, script, "--quick", "--steps", "1", "--levers",
                           "baseline,no_checkpointing,fsdp_one_rank", "--jsonl", str(out), "--profile-row", "none"],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["row"] for r in rows] == ["baseline", "no_checkpointing", "fsdp_one_rank", "baseline"]
    for r in rows:
        assert r["tokens_per_s_median"] > 0 and r["mfu"] is None and r["mfu_prime_rl"] is None
        assert r["warmup_steps"] == 1  # eager rows: nothing to compile
    assert rows[1]["switches"]["enable_gradient_checkpointing"] is False
    assert re.search(r"no_checkpointing +\d+ \(\d+–\d+\) +\d+\.\d+x", proc.stdout), proc.stdout
    import torch

    if not torch.cuda.is_available():
        full = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=60)
        assert full.returncode == 2 and "needs a CUDA GPU" in full.stdout
