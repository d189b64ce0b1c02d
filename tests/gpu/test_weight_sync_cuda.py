"""Weight sync from a model on CUDA: the filesystem snapshot holds its exact weights, a receiver loads them,
and (two GPUs) NCCL carries them into a receiver's CUDA model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu.helpers import DEVICE
from tests.integration.test_weight_sync_gloo import Fleet
from tests.weight_receiver import ModelEngine
from tether.commands.tiny_model import make_tiny_model
from tether.config import TetherConfig
from weight_sync.sender import WeightSender
from weight_sync.snapshot import latest_snapshot, read_snapshot


def _cfg(tmp_path: Path, transport: dict) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "run": {"run_id": "ws-gpu", "output_dir": str(tmp_path)},
            "weight_sync": {
                "transport": transport,
                "verify_checksums": True,
                "prepare_timeout_s": 20,
                "transfer_timeout_s": 60,
                "commit_timeout_s": 60,
            },
        }
    )


def _cuda_learner(tmp_path: Path, device: torch.device | str = DEVICE) -> torch.nn.Module:
    path = make_tiny_model(tmp_path / "learner", hidden=128, layers=2, heads=4, seed=1)
    return ModelEngine.from_path(path).model.to(device)


@pytest.mark.gpu
def test_snapshot_of_a_cuda_model_holds_its_exact_weights(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, {"type": "filesystem"})
    learner = _cuda_learner(tmp_path)
    sender = WeightSender(cfg, model=learner, servers=[])
    try:
        sender.publish(1)
    finally:
        sender.close()
    version, folder = latest_snapshot(tmp_path / "ws-gpu" / "snapshots")
    assert version == 1
    expected = {name: p.detach().cpu() for name, p in learner.named_parameters()}
    seen = dict(read_snapshot(folder))
    assert set(seen) == set(expected)
    for name, tensor in seen.items():
        torch.testing.assert_close(tensor.cpu(), expected[name], rtol=0, atol=0)


@pytest.mark.gpu
def test_filesystem_update_from_cuda_reaches_a_receiver(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = _cfg(tmp_path, {"type": "filesystem"})
    learner = _cuda_learner(tmp_path)
    fleet = Fleet()
    try:
        address = fleet.add(tiny_model_dir, cfg)
        sender = WeightSender(cfg, model=learner, servers=[address])
        try:
            assert sender.publish(1)["weight_sync/reached"] == 1, sender.last_dropped
        finally:
            sender.close()
        engine = fleet.engines[0]
        assert engine.policy_version == 1
        for name, param in engine.model.named_parameters():
            torch.testing.assert_close(param.cpu(), dict(learner.named_parameters())[name].cpu(), rtol=0, atol=0)
    finally:
        fleet.close()


@pytest.mark.gpu2
def test_nccl_update_reaches_a_receiver_on_another_gpu(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Sender on GPU 0, receiver's model on GPU 1 (NCCL cannot put two ranks on one GPU)."""
    cfg = _cfg(tmp_path, {"type": "nccl", "master_port": 0})
    learner = _cuda_learner(tmp_path, "cuda:0")
    fleet = Fleet()
    try:
        address = fleet.add(tiny_model_dir, cfg)
        fleet.engines[0].model.to("cuda:1")
        sender = WeightSender(cfg, model=learner, servers=[address])
        try:
            metrics = sender.publish(1)
            assert metrics["weight_sync/reached"] == 1, sender.last_dropped
        finally:
            sender.close()
        engine = fleet.engines[0]
        for name, param in engine.model.named_parameters():
            assert param.device == torch.device("cuda", 1)
            torch.testing.assert_close(param.cpu(), dict(learner.named_parameters())[name].cpu(), rtol=0, atol=0)
    finally:
        fleet.close()
