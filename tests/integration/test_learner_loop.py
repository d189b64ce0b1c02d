"""The learner process end to end: torchrun with 2 gloo ranks, a real Redis, a thread that plays the rollout
fleet (answers at the current version), weights published as filesystem snapshots, checkpoints, the HF
export, the status hash — then ``--resume`` continues where the run stopped."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import redis
import yaml

from tether.metrics import read_metrics

pytestmark = pytest.mark.slow


def _fake_fleet(url: str, run_id: str, stop: threading.Event) -> None:
    """Writes groups tagged with the published version until told to stop (what rollout servers do)."""
    from buffer import RedisKeys, TrajectoryWriter, read_version
    from learner.synthetic import make_groups
    from tether.config import BufferConfig

    client = redis.Redis.from_url(url)
    keys = RedisKeys(run_id)
    writer = TrajectoryWriter(client, keys, BufferConfig(redis_url=url, max_trajectory_groups=8))
    seed = 0
    while not stop.is_set():
        version = read_version(client, keys)
        for g in make_groups(1, 4, vocab=256, seed=seed, version=version):
            try:
                writer.put(g, timeout_s=0.5)
            except Exception:
                continue
        seed += 1
    client.close()


def _learner(cfg_path: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["-m", "learner", "--config", str(cfg_path), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def test_learner_trains_publishes_checkpoints_and_resumes(tiny_model_dir: Path, redis_url: str, tmp_path: Path):
    run_id = "loop"
    cfg = {
        "run": {"run_id": run_id, "output_dir": str(tmp_path), "loggers": ["console"]},
        "model": {"path": str(tiny_model_dir)},
        "buffer": {"redis_url": redis_url},
        "rollout": {"max_tokens": 32},
        "learner": {
            "total_steps": 3,
            "train_batch_size": 2,
            "lr": 1e-4,
            "checkpoint_every": 2,
            "max_token_len_per_gpu": 64,
            "data_path": "demo:charclass",
            "read_timeout_s": 60,
        },
        "algorithm": {"max_staleness": 1},
        "weight_sync": {"sync_every": 1, "transport": {"type": "filesystem"}},
    }
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    stop = threading.Event()
    fleet = threading.Thread(target=_fake_fleet, args=(redis_url, run_id, stop), daemon=True)
    fleet.start()
    try:
        proc = _learner(cfg_path)
        assert proc.returncode == 0, proc.stderr[-4000:]
        run = tmp_path / run_id
        rows = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert all(r["staleness/max"] <= 1 for r in rows)
        assert {"loss/pg", "loss/total", "actor/clipfrac", "timing/wait_data", "perf/tokens_per_s"} <= set(rows[0])
        assert (run / "checkpoints" / "step_2" / "trainer_state.json").exists()
        assert (run / "checkpoints" / "step_3" / "trainer_state.json").exists()
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(run / "final")
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        status = client.hgetall(f"tether:{run_id}:learner")
        assert status["step"] == "3" and status["version"] == "3"
        assert client.get(f"tether:{run_id}:version") == "3"

        cfg["learner"]["total_steps"] = 5
        cfg_path.write_text(yaml.safe_dump(cfg))
        proc = _learner(cfg_path, "--resume")
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
        assert rows[-1]["learner/version"] == 5
        assert client.hgetall(f"tether:{run_id}:learner")["step"] == "5"
        client.close()
    finally:
        stop.set()
        fleet.join(timeout=10)
