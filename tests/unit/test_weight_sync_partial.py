"""A streamed update that fails half-way leaves the weights mixed; the receiver makes them one version again.

The vLLM worker loads a collective update as it arrives (at most two buckets beside the model), so a
transfer that breaks half-way has already overwritten part of the model: serving on would mix two versions
under the old version's tag. The receiver restores the newest snapshot instead (an older version, said so).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.weight_receiver import ModelEngine
from tether.commands.tiny_model import make_tiny_model
from tether.config import TetherConfig
from tether.v1 import control_pb2
from weight_sync.inbox import LocalDelivery
from weight_sync.loading import Tally
from weight_sync.receiver import WeightReceiver, WeightSyncError
from weight_sync.sender import WeightSender


class _HalfLoaded(LocalDelivery):
    """Loads part of the update (zeroes the embedding: the mixed model), then the transfer fails."""

    async def start(self, plan: control_pb2.WeightUpdatePlan) -> None:
        pass  # nothing to join: the transfer is the part that fails

    async def finish(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> Tally:
        with torch.no_grad():
            self.loader.model.get_input_embeddings().weight.zero_()
        # As it arrives from the worker: text, across collective_rpc.
        raise RuntimeError("weights partially loaded: update u2: 3 of 9 tensors handed over when the transfer failed")


async def test_a_half_loaded_update_is_replaced_by_the_newest_snapshot(tmp_path: Path, tiny_model_dir: Path) -> None:
    cfg = TetherConfig.model_validate(
        {"weight_sync": {"transport": {"type": "filesystem", "path": str(tmp_path / "snaps")}}}
    )
    learner = ModelEngine.from_path(make_tiny_model(tmp_path / "learner", hidden=128, layers=2, heads=4, seed=1))
    sender = WeightSender(cfg, model=learner.model, servers=[])
    sender.publish(1)  # no servers: the snapshot of version 1 only
    engine = ModelEngine.from_path(tiny_model_dir)
    receiver = WeightReceiver(engine, cfg, delivery=_HalfLoaded(engine, cfg))
    gloo = control_pb2.CollectiveSource(
        backend="gloo", init_method="tcp://127.0.0.1:1", world_size=2, rank=1, group_epoch=1
    )
    plan = control_pb2.WeightUpdatePlan(
        version=2, update_id="u2", tensors=sender.layout.tensors, buckets=sender.layout.buckets, collective=gloo
    )
    assert (await receiver.prepare(plan)).ready
    with pytest.raises(WeightSyncError, match="restored snapshot version 1"):
        await receiver.commit(control_pb2.CommitWeightUpdateRequest(update_id="u2", version=2))
    assert engine.policy_version == 1
    for name, param in engine.model.named_parameters():
        torch.testing.assert_close(param, dict(learner.model.named_parameters())[name], rtol=0, atol=0)
    assert not receiver._paused


class _Broken(LocalDelivery):
    """The transfer fails before loading anything; the receiver then falls back to the newest snapshot."""

    async def start(self, plan: control_pb2.WeightUpdatePlan) -> None:
        pass

    async def finish(self, plan: control_pb2.WeightUpdatePlan, *, timeout_s: float) -> Tally:
        raise RuntimeError("the transfer broke before its first tensor")


async def test_a_snapshot_that_fails_half_way_is_said_to_mix_versions(tmp_path: Path, tiny_model_dir: Path) -> None:
    # The fallback snapshot's first shard loads, its second has a tensor of the wrong shape: the model is
    # then mixed, and no snapshot can repair it. The error must say so, not that the old weights serve on.
    import json

    from safetensors.torch import save_file

    from weight_sync.snapshot import INDEX_FILE, VERSION_FILE, snapshot_dir

    cfg = TetherConfig.model_validate(
        {"weight_sync": {"transport": {"type": "filesystem", "path": str(tmp_path / "snaps")}}}
    )
    engine = ModelEngine.from_path(tiny_model_dir)
    (first, param), (second, _) = list(engine.model.named_parameters())[:2]
    folder = snapshot_dir(tmp_path / "snaps", 2)
    folder.mkdir(parents=True)
    save_file({first: torch.zeros_like(param)}, str(folder / "a.safetensors"))
    save_file({second: torch.zeros(3, 3)}, str(folder / "b.safetensors"))
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {first: "a.safetensors", second: "b.safetensors"}}))
    (folder / VERSION_FILE).write_text("2\n")
    receiver = WeightReceiver(engine, cfg, delivery=_Broken(engine, cfg))
    gloo = control_pb2.CollectiveSource(
        backend="gloo", init_method="tcp://127.0.0.1:1", world_size=2, rank=1, group_epoch=1
    )
    assert (await receiver.prepare(control_pb2.WeightUpdatePlan(version=2, update_id="u2", collective=gloo))).ready
    with pytest.raises(WeightSyncError, match=r"half-way through the load.*mix versions"):
        await receiver.commit(control_pb2.CommitWeightUpdateRequest(update_id="u2", version=2))
    assert engine.policy_version == 0 and not bool(param.any())  # the first shard did land: mixed, as said
    assert not receiver._paused
