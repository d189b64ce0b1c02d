"""``bench/weight_delta.py --quick`` runs the real trainer, publishes versions, and reports its figures.

No timing is asserted: only that every figure and table field is there, that byte ratios are ratios
(in (0, 1.5]), and that the store's readers got versions (the script itself exits non-zero when a decoded
version differs from what was published).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_weight_delta_bench_quick(tmp_path: Path) -> None:
    figures_file = tmp_path / "figures.jsonl"
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "weight_delta.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "TETHER_BENCH_RESULTS": str(figures_file)},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"hash MB/s .*xxh3_128 \d+.*blake2b \d+", proc.stdout)
    assert "| lr | repeats | changed bf16 % | delta / full bf16 | delta / full fp32 |" in proc.stdout
    for lr in ("1e-06", "1e-05"):
        assert re.search(rf"FIGURE weight_delta/lr{lr}_delta_vs_full_bf16: \d+\.\d+", proc.stdout)

    figures = {f["name"]: f for f in map(json.loads, figures_file.read_text().splitlines())}
    for lr in ("1e-06", "1e-05"):
        for key in ("delta_vs_full_bf16", "delta_vs_full_fp32", "encode_s_vs_full", "decode_s_vs_full"):
            f = figures[f"weight_delta/lr{lr}_{key}"]
            assert f["repeats"] >= 3 and f["quick"] and f["spread"][0] <= f["ratio"] <= f["spread"][1]
            assert f["ratio"] > 0
        assert 0 < figures[f"weight_delta/lr{lr}_delta_vs_full_bf16"]["ratio"] <= 1.5

    results = json.loads((out / "results.json").read_text())
    assert set(results["hash_MBps"]) >= {"xxh3_128", "blake2b"}
    for lr in ("1e-06", "1e-05"):
        reps = results["runs"][lr]
        assert len(reps) >= 3
        for rep in reps:
            s = rep["summary"]
            for key in ("delta_vs_full_bf16", "delta_vs_full_fp32", "fp32_delta_vs_full_fp32",
                        "follower_vs_full_bf16", "new_reader_vs_full_bf16", "new_reader_max_vs_full_bf16"):  # fmt: skip
                assert 0 < s[key] <= 1.5, (lr, key, s[key])
            assert s["encode_MBps"] > 0 and s["decode_MBps"] > 0 and 0 < s["changed_bf16"] <= 1
            assert sum(s["picks"].values()) == len(rep["steps"]) * max(1, sum(rep["steps"][0]["picks"].values()))
            assert rep["new_reader_chain"][0].endswith(":base")
