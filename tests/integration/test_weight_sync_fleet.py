"""Receivers as real subprocesses: a receiver SIGKILLed mid-transfer, and one restarted afterwards."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import wait_gone
from tests.weight_receiver import ModelEngine, ReceiverProcess
from tether.config import TetherConfig
from tether.config.loader import load_config
from weight_sync.sender import WeightSender
from weight_sync.snapshot import latest_snapshot, read_snapshot

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _config(tmp_path: Path) -> tuple[Path, TetherConfig]:
    data = {
        "run": {"run_id": "fleet", "output_dir": str(tmp_path / "runs")},
        "weight_sync": {
            "transport": {"type": "gloo", "master_port": 0},
            "bucket_size_mb": 0.05,
            "verify_checksums": True,
            "prepare_timeout_s": 5,
            "transfer_timeout_s": 10,
            "commit_timeout_s": 15,
        },
    }
    path = tmp_path / "tether.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, load_config(path)


def test_killed_receiver_does_not_stall_the_learner_and_comes_back_current(tmp_path: Path, tiny_model_dir: Path):
    config_path, cfg = _config(tmp_path)
    learner = ModelEngine.from_path(tiny_model_dir).model
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.01)
    victim = ReceiverProcess(config=config_path, model=tiny_model_dir, workdir=tmp_path)
    survivor = ReceiverProcess(config=config_path, model=tiny_model_dir, workdir=tmp_path)
    servers = [victim.address, survivor.address]
    sender = WeightSender(cfg, model=learner, servers=lambda: list(servers))
    try:
        assert sender.publish(1)["weight_sync/reached"] == 2

        def kill_mid_transfer(bucket: int, total: int) -> None:
            if bucket == 1:
                assert total > 4
                victim.kill()
                assert wait_gone(victim.proc.pid)

        sender.on_bucket = kill_mid_transfer
        started = time.monotonic()
        metrics = sender.publish(2)
        elapsed = time.monotonic() - started
        sender.on_bucket = None
        budget = (
            cfg.weight_sync.prepare_timeout_s + cfg.weight_sync.transfer_timeout_s + cfg.weight_sync.commit_timeout_s
        )
        assert elapsed < budget, f"publish took {elapsed:.1f}s, past the deadlines' sum {budget}s"
        assert metrics["weight_sync/dropped"] >= 1 and victim.address in sender.last_dropped
        # The survivor still reached v2 (over the wire, or from the v2 snapshot after the group broke).
        assert metrics["weight_sync/reached"] == 1, sender.last_dropped

        # The dead address is still listed (as a registry would until its heartbeat expires): dropped at
        # prepare, and the survivor is re-planned under a new group epoch.
        with torch.no_grad():
            learner.model.norm.weight.add_(1.0)
        metrics = sender.publish(3)
        assert metrics["weight_sync/reached"] == 1 and list(sender.last_dropped) == [victim.address]

        restarted = ReceiverProcess(config=config_path, model=tiny_model_dir, workdir=tmp_path)
        assert restarted.start_version == 3  # caught up from the snapshot at start
        servers[:] = [restarted.address, survivor.address]
        metrics = sender.publish(4)
        assert metrics["weight_sync/reached"] == 2 and metrics["weight_sync/dropped"] == 0, sender.last_dropped
        version, path = latest_snapshot(Path(cfg.run.output_dir) / "fleet" / "snapshots")
        assert version == 4
        expected = dict(learner.named_parameters())
        for name, tensor in read_snapshot(path):
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
        restarted.stop()
    finally:
        sender.close()
        victim.kill()
        survivor.stop()
