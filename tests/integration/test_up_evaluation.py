"""``tether up`` with evaluation on: a short real run (embedded Redis, learner under torchrun, two rollout
servers) logs validation rounds before training, every ``test_freq`` steps and at the end, and its training
books are exactly those of a run without evaluation (every validation sample stayed off the trajectories
stream and out of the counters)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.test_up import REPO, processes_mentioning, write_config
from tether.metrics import read_metrics

STEPS, BATCH, VAL_PROMPTS, K = 4, 4, 6, 2


@pytest.mark.slow
def test_evaluation_rounds_are_logged_and_never_trained_on(tmp_path: Path, tiny_model_dir: Path) -> None:
    run_id = "up-eval"
    path = write_config(tmp_path, tiny_model_dir, run_id=run_id, steps=STEPS)
    cfg = yaml.safe_load(path.read_text())
    cfg["learner"].update(val_data_path="demo:charclass", test_freq=2, val_before_train=True, val_n=K,
                          val_temperature=1.0, val_max_prompts=VAL_PROMPTS, val_timeout_s=240)  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    result = subprocess.run([sys.executable, "-m", "tether", "up", "--config", str(path)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    run_dir = tmp_path / "runs" / run_id
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.out")))
    assert result.returncode == 0, result.stderr[-3000:] + logs

    rows = read_metrics(run_dir / "metrics.jsonl")
    val = sorted((r for r in rows if r.get("val/k") is not None), key=lambda r: r["step"])
    assert [r["step"] for r in val] == [0, 2, 4]  # before training, every test_freq, and the last step
    for r in val:
        assert r["val/prompts"] == VAL_PROMPTS and r["val/missing"] == 0, r
        assert r["val/k"] == K and 0.0 <= r["val/mean@k"] <= 1.0 and r["val/pass@1"] <= r["val/pass@k"]
    assert val[0]["val/version"] == 0 and val[-1]["val/version"] == STEPS  # sync_every 1: one version a step
    assert all(r.get("reward/mean") is None for r in val)  # evaluation rows are not training rows

    train = [r for r in rows if r.get("reward/mean") is not None]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    stats = json.loads((run_dir / "buffer_stats.json").read_text())
    assert stats["buffer/acknowledged"] == sum(r["data/groups"] for r in train) == STEPS * BATCH
    assert stats["buffer/produced"] == (
        stats["buffer/acknowledged"] + stats["buffer/dropped_stale"] + stats["buffer/depth"]
    )
    # Each training prompt makes at most one group; 3 rounds x 6 validation prompts would overflow this
    # bound (issued <= (max_staleness + steps + 1) x batch = 24) had any of them become a group.
    assert stats["buffer/produced"] <= stats["buffer/prompts_issued"] <= (1 + STEPS + 1) * BATCH
    assert (run_dir / "plots" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert processes_mentioning(str(run_dir)) == []
