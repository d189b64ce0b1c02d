"""A user's dataset end to end: ``tether up`` trains on verl's parquet layout (chat-message prompts,
``reward_model.ground_truth``) with rewards routed by ``data_source`` on the rollout server, evaluates a
saved ``datasets`` folder split by source, then ``--resume`` continues from the dataset position.
(Training from a ``datasets`` folder shares every line after opening the table; its resume position is
checked in tests/unit/test_learner_datasets.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.test_up import REPO, write_config
from tests.unit.test_learner_datasets import verl_rows, write_verl_parquet
from tether.metrics import read_metrics


def _up(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tether", "up", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


def _logs(run_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*.out")))


@pytest.mark.slow
def test_verl_parquet_trains_scores_by_source_evaluates_a_datasets_folder_and_resumes(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import datasets

    data = write_verl_parquet(tmp_path / "train.parquet", verl_rows(12))
    val = tmp_path / "val_ds"  # what TRL users hold: a saved datasets folder, same layout
    datasets.Dataset.from_list(verl_rows(4)).save_to_disk(val)
    cfg_path = write_config(tmp_path, tiny_model_dir, run_id="data", steps=2, reward={"type": "data_source"},
                            checkpoint_every=1)  # fmt: skip
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["rollout"]["num_servers"] = 1
    cfg["learner"].update(data_path=str(data), val_data_path=str(val), test_freq=2)
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "runs" / "data"

    first = _up("--config", str(cfg_path))
    assert first.returncode == 0, first.stderr[-3000:] + _logs(run_dir)
    evaluated = [r for r in read_metrics(run_dir / "metrics.jsonl") if "val/k" in r][-1]
    # Two prompts of each source, every one scored by its route on the rollout server.
    assert evaluated["val/openai/gsm8k/prompts"] == 2 and evaluated["val/lighteval/MATH/prompts"] == 2, evaluated
    assert evaluated["val/missing"] == 0 and "val/openai/gsm8k/reward_mean" in evaluated
    assert "rows=12" in (run_dir / "logs" / "learner.out").read_text()  # dataset_opened

    second = _up("--config", str(run_dir / "config.yaml"), "--resume", "--learner.total_steps", "3")
    assert second.returncode == 0, second.stderr[-3000:] + _logs(run_dir)
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("reward/mean") is not None]
    assert [r["step"] for r in steps] == [1, 2, 3]
    positions = [r["learner/data_position"] for r in steps]
    assert positions == sorted(positions) and positions[-1] > 12  # into the second epoch, never back
    stats = json.loads((run_dir / "buffer_stats.json").read_text())
    assert stats["buffer/dead_letter"] == 0  # no group failed scoring: every source had its scorer
    assert stats["buffer/acknowledged"] == 3 * 4
