"""WeightReceiver against a real tiny transformers model: pause → load → version → resume, and failures."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.weight_receiver import ModelEngine
from tether.commands.tiny_model import make_tiny_model
from tether.config import TetherConfig
from tether.redis_server import free_port
from tether.v1 import control_pb2
from weight_sync.receiver import WeightReceiver, WeightSyncError
from weight_sync.sender import WeightSender
from weight_sync.snapshot import snapshot_dir

PROMPT = torch.tensor([[60, 61, 62, 63, 64]])


def greedy(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=12, do_sample=False)
    return out[0, PROMPT.shape[1] :].tolist()


@pytest.fixture(scope="module")
def learner_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same architecture as ``tiny_model_dir``, other weights: what the learner 'trained'."""
    return make_tiny_model(tmp_path_factory.mktemp("learner"), hidden=128, layers=2, heads=4, seed=1)


def _cfg(tmp_path: Path, **ws) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "weight_sync": {
                "transport": {"type": "filesystem", "path": str(tmp_path / "snaps")},
                "verify_checksums": True,
                **ws,
            }
        }
    )


def _publish_snapshot(cfg: TetherConfig, learner_dir: Path, version: int) -> tuple[WeightSender, torch.nn.Module]:
    learner = ModelEngine.from_path(learner_dir).model
    sender = WeightSender(cfg, model=learner, servers=[])
    sender.publish(version)  # no servers: writes the snapshot only
    return sender, learner


def _plan(sender: WeightSender, version: int, **source) -> control_pb2.WeightUpdatePlan:
    return control_pb2.WeightUpdatePlan(
        version=version,
        tensors=sender.layout.tensors,
        buckets=sender.layout.buckets,
        update_id=f"u{version}",
        **source,
    )


def _fs(cfg: TetherConfig, version: int) -> dict:
    path = snapshot_dir(Path(cfg.weight_sync.transport.path), version)
    return {"filesystem": control_pb2.FilesystemSource(path=str(path))}


async def test_commit_loads_the_new_weights_in_place(tmp_path: Path, tiny_model_dir: Path, learner_dir: Path) -> None:
    cfg = _cfg(tmp_path)
    sender, learner = _publish_snapshot(cfg, learner_dir, 1)
    engine = ModelEngine.from_path(tiny_model_dir)
    embed = engine.model.get_input_embeddings().weight
    before = greedy(engine.model)
    assert before != greedy(learner)
    receiver = WeightReceiver(engine, cfg)

    plan = _plan(sender, 1, **_fs(cfg, 1), inflight=control_pb2.INFLIGHT_POLICY_DRAIN)
    ready = await receiver.prepare(plan)
    assert ready.ready and ready.current_version == 0 and engine.paused == "drain"
    done = await receiver.commit(control_pb2.CommitWeightUpdateRequest(update_id="u1", version=1))

    assert done.policy_version == engine.policy_version == 1 and engine.paused is None
    assert done.bytes_received == sender.layout.num_bytes
    assert greedy(engine.model) == greedy(learner)  # generation now uses the new weights
    learned = dict(learner.named_parameters())
    for name, param in engine.model.named_parameters():
        torch.testing.assert_close(param, learned[name], rtol=0, atol=0)
        assert done.checksums[name] == pytest.approx(sender.last_checksums[name], rel=1e-12)
    # Loaded in place: the same Parameter objects, and tied embeddings still tied.
    assert engine.model.get_input_embeddings().weight is embed
    assert engine.model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()


async def test_abort_and_stale_and_invalid_plans(tmp_path: Path, tiny_model_dir: Path, learner_dir: Path) -> None:
    cfg = _cfg(tmp_path)
    sender, _ = _publish_snapshot(cfg, learner_dir, 1)
    engine = ModelEngine.from_path(tiny_model_dir)
    before = greedy(engine.model)
    receiver = WeightReceiver(engine, cfg)

    with pytest.raises(ValueError, match="source"):
        await receiver.prepare(_plan(sender, 1))
    # Found by the gRPC fuzz: a version past int32 was committed, then every trajectory write failed.
    for version in (0, -1, 2**31, 2**63 - 1):
        with pytest.raises(ValueError, match="version"):
            await receiver.prepare(_plan(sender, version, **_fs(cfg, 1)))
    assert engine.pauses == 0  # rejected before pausing anything

    assert (await receiver.prepare(_plan(sender, 1, **_fs(cfg, 1)))).ready
    await receiver.abort(control_pb2.AbortWeightUpdateRequest(update_id="u1", reason="test"))
    assert engine.paused is None and engine.policy_version == 0 and greedy(engine.model) == before
    with pytest.raises(WeightSyncError):
        await receiver.commit(control_pb2.CommitWeightUpdateRequest(update_id="u1", version=1))

    engine.policy_version = 3
    declined = await receiver.prepare(_plan(sender, 2, **_fs(cfg, 1)))
    assert not declined.ready and declined.current_version == 3 and engine.paused is None


async def test_watchdog_resumes_when_the_learner_vanishes(tmp_path: Path, tiny_model_dir: Path, learner_dir: Path):
    cfg = _cfg(tmp_path, prepare_timeout_s=0.1, transfer_timeout_s=0.1, commit_timeout_s=0.1)
    sender, _ = _publish_snapshot(cfg, learner_dir, 1)
    engine = ModelEngine.from_path(tiny_model_dir)
    receiver = WeightReceiver(engine, cfg)
    await receiver.prepare(_plan(sender, 1, **_fs(cfg, 1)))
    assert engine.paused == "keep"
    await asyncio.sleep(0.8)  # no commit ever comes
    assert engine.paused is None and engine.policy_version == 0


async def test_failed_transfer_falls_back_to_the_snapshot(tmp_path: Path, tiny_model_dir: Path, learner_dir: Path):
    cfg = _cfg(tmp_path, prepare_timeout_s=0.3, transfer_timeout_s=0.3, commit_timeout_s=5)
    sender, learner = _publish_snapshot(cfg, learner_dir, 1)
    # A real store that never says "go": the collective receive fails on its own deadline.
    store = dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=5)
    )
    source = control_pb2.CollectiveSource(
        backend="gloo", init_method=f"tcp://127.0.0.1:{store.port}", world_size=2, rank=1, group_epoch=1
    )
    engine = ModelEngine.from_path(tiny_model_dir)
    receiver = WeightReceiver(engine, cfg)
    assert (await receiver.prepare(_plan(sender, 1, collective=source))).ready
    done = await receiver.commit(control_pb2.CommitWeightUpdateRequest(update_id="u1", version=1))
    assert done.policy_version == engine.policy_version == 1 and engine.paused is None
    assert greedy(engine.model) == greedy(learner)


async def test_catch_up_loads_the_newest_snapshot(tmp_path: Path, tiny_model_dir: Path, learner_dir: Path) -> None:
    cfg = _cfg(tmp_path)
    engine = ModelEngine.from_path(tiny_model_dir)
    receiver = WeightReceiver(engine, cfg)
    assert await receiver.catch_up() == 0  # nothing published yet
    _, learner = _publish_snapshot(cfg, learner_dir, 1)
    _publish_snapshot(cfg, learner_dir, 2)
    assert await receiver.catch_up() == 2
    assert engine.paused is None and greedy(engine.model) == greedy(learner)
