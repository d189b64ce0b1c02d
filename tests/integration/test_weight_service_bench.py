"""``bench/weight_service.py --quick`` builds its hosts (network namespaces, rate-limited links), runs real
rollout servers pulling from the store, and reports every figure; it leaves no namespace behind.

No timing is asserted: only that the run finishes, that each figure is there with its spread and repeats,
and that the tables it prints are there. Root only (namespaces): skipped with the reason elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.netns_links import PREFIX, can_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
BENCH = Path(__file__).resolve().parents[2] / "bench" / "weight_service.py"


@pytest.fixture(scope="module")
def hosts_ok() -> None:
    reason = can_run()
    if reason:
        pytest.skip(reason)


def test_weight_service_bench_quick(tmp_path: Path, hosts_ok: None) -> None:
    figures_file, out = tmp_path / "figures.jsonl", tmp_path / "rounds.json"
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--quick", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TETHER_BENCH_RESULTS": str(figures_file)},
    )
    try:
        stdout, stderr = proc.communicate(timeout=1100)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]

    names = {f"weight_service/{n}" for n in (
        "update_vs_raw_1gbit_lr1e-06", "update_vs_raw_1gbit_lr1e-05", "delta_bytes_vs_full_lr1e-06",
        "delta_bytes_vs_full_lr1e-05", "publish_2_over_1", "update_2_over_1", "origin_bytes_2_over_1",
        "push_vs_store_update_2srv",
        *(f"join_v{v}_{what}" for v in (20, 30) for what in ("vs_link", "pull_vs_link", "pull_vs_raw")),
    )}  # fmt: skip
    figures = {f["name"]: f for f in map(json.loads, figures_file.read_text().splitlines())}
    assert set(figures) == names
    for f in figures.values():
        assert f["quick"] and f["repeats"] >= 3 and f["spread"][0] <= f["ratio"] <= f["spread"][1], f
        assert f"FIGURE {f['name']}:" in stdout
    assert 0 < figures["weight_service/delta_bytes_vs_full_lr1e-06"]["ratio"] < 1
    for text in ("where the update's time goes", "| servers | publish s (learner)", "push vs store, 2 server(s)",
                 "join at v20 (v20.base + 0 deltas", "join at v30 (v20.base + 10 deltas"):  # fmt: skip
        assert text in stdout, text
    rounds = json.loads(out.read_text())
    assert {r["2"]["weight_sync/reached"] for r in rounds["scale"]} == {2.0}

    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{PREFIX}{proc.pid}-" not in left
