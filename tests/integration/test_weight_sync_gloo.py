"""Gloo transfer end to end in one process: the learner's sender and two receivers behind real gRPC servers.

The receivers' grpc.aio servers run on an event loop in a background thread because the sender is
blocking code (as in the learner); gloo groups between threads are as real as between processes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.weight_receiver import ControlServicer, ModelEngine
from tether.commands.tiny_model import make_tiny_model
from tether.config import TetherConfig
from tether.v1 import control_pb2_grpc
from weight_sync.collective import CollectiveReceive
from weight_sync.receiver import WeightReceiver
from weight_sync.sender import WeightSender
from weight_sync.snapshot import latest_snapshot, read_snapshot, snapshot_root

pytestmark = pytest.mark.timeout(120)
PROMPT = torch.tensor([[60, 61, 62, 63, 64]])


def greedy(model: torch.nn.Module) -> list[int]:
    with torch.no_grad():
        out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), max_new_tokens=12, do_sample=False)
    return out[0, PROMPT.shape[1] :].tolist()


class Fleet:
    """Receivers (engine + WeightReceiver + Control server) on one background event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.servers: list[grpc.aio.Server] = []
        self.engines: list[ModelEngine] = []
        self.receivers: list[WeightReceiver] = []

    def add(self, model_dir: Path, cfg: TetherConfig) -> str:
        async def start() -> str:
            engine = ModelEngine.from_path(model_dir)
            receiver = WeightReceiver(engine, cfg, delivery=engine.weight_delivery(cfg))
            await receiver.catch_up()
            server = grpc.aio.server()
            control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(receiver, engine), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            self.engines.append(engine)
            self.receivers.append(receiver)
            return f"127.0.0.1:{port}"

        return asyncio.run_coroutine_threadsafe(start(), self.loop).result(60)

    def close(self) -> None:
        for server in self.servers:
            asyncio.run_coroutine_threadsafe(server.stop(None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def receive_buffers(receiver: WeightReceiver) -> set[int]:
    """Addresses of every receive buffer a receiver holds (both sets)."""
    return {flat.data_ptr() for flats in collective(receiver)._sets for flat in flats}


def collective(receiver: WeightReceiver) -> CollectiveReceive:
    """The receiver's collective receive: its group and its (up to two) sets of receive buffers."""
    return receiver.delivery.inbox.end("collective").receive


def storage_in(param: torch.Tensor, buffers: set[int]) -> bool:
    """Whether ``param`` lives in one of the receive buffers (adopted, not copied)."""
    return param.untyped_storage().data_ptr() in buffers


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    yield f
    f.close()


def _cfg(tmp_path: Path, *, bucket_size_mb: float = 0.25, **weight_sync: object) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "run": {"run_id": "ws", "output_dir": str(tmp_path)},
            "weight_sync": {
                "transport": {"type": "gloo", "master_port": 0},
                "bucket_size_mb": bucket_size_mb,
                "verify_checksums": True,
                "prepare_timeout_s": 10,
                "transfer_timeout_s": 20,
                "commit_timeout_s": 20,
                **weight_sync,
            },
        }
    )


@pytest.mark.parametrize("bucket_size_mb", [0.25, 1e-6])  # bucketed, and one tensor per bucket
def test_gloo_update_reaches_every_receiver(
    tmp_path: Path, tiny_model_dir: Path, fleet: Fleet, bucket_size_mb: float
) -> None:
    cfg = _cfg(tmp_path, bucket_size_mb=bucket_size_mb)
    learner = ModelEngine.from_path(make_tiny_model(tmp_path / "learner", hidden=128, layers=2, heads=4, seed=1)).model
    addresses = [fleet.add(tiny_model_dir, cfg) for _ in range(2)]
    assert greedy(fleet.engines[0].model) != greedy(learner)

    sender = WeightSender(cfg, model=learner, servers=addresses)
    try:
        metrics = sender.publish(1)
        assert metrics["weight_sync/reached"] == 2 and metrics["weight_sync/dropped"] == 0, sender.last_dropped
        assert metrics["weight_sync/bytes"] == sender.layout.num_bytes > 0 and metrics["weight_sync/seconds"] > 0
        expected = dict(learner.named_parameters())
        for engine in fleet.engines:
            assert engine.policy_version == 1 and engine.paused is None
            for name, param in engine.model.named_parameters():
                torch.testing.assert_close(param, expected[name], rtol=0, atol=0)
            assert greedy(engine.model) == greedy(learner)

        # Same membership: the group is reused (no rebuild), and later versions land too, packed into
        # the sender's buffers of the first. Receivers loaded by adopting the received buckets (no copy),
        # so version 2 goes into a second set and version 3 into the first again: two sets, no more.
        slots = sender.pool.allocated
        first = [receive_buffers(r) for r in fleet.receivers]
        for engine, buffers in zip(fleet.engines, first, strict=True):
            assert all(storage_in(p, buffers) for p in engine.model.parameters())
        for version in (2, 3):
            with torch.no_grad():
                for p in learner.parameters():
                    p.mul_(1.5)
            metrics = sender.publish(version)
            assert metrics["weight_sync/reached"] == 2 and metrics["weight_sync/group_rebuild_seconds"] == 0
            assert sender.pool.allocated == slots
            for engine, receiver in zip(fleet.engines, fleet.receivers, strict=True):
                assert engine.policy_version == version
                assert len(collective(receiver)._sets) == 2
                assert all(storage_in(p, receive_buffers(receiver)) for p in engine.model.parameters())
                for name, param in engine.model.named_parameters():
                    torch.testing.assert_close(param, expected[name], rtol=0, atol=0)
                assert greedy(engine.model) == greedy(learner)
        assert [receive_buffers(r) for r in fleet.receivers] != first  # the second set is new memory
    finally:
        sender.close()


def test_a_server_joining_later_converges(tmp_path: Path, tiny_model_dir: Path, fleet: Fleet) -> None:
    cfg = _cfg(tmp_path)
    learner = ModelEngine.from_path(make_tiny_model(tmp_path / "learner", hidden=128, layers=2, heads=4, seed=1)).model
    addresses = [fleet.add(tiny_model_dir, cfg)]
    sender = WeightSender(cfg, model=learner, servers=lambda: list(addresses))
    try:
        assert sender.publish(1)["weight_sync/reached"] == 1
        addresses.append(fleet.add(tiny_model_dir, cfg))  # starts late: catches up from the v1 snapshot
        assert fleet.engines[1].policy_version == 1
        with torch.no_grad():
            learner.model.norm.weight.add_(1.0)
        metrics = sender.publish(2)  # membership changed: a new group epoch with both
        assert metrics["weight_sync/reached"] == 2 and metrics["weight_sync/group_rebuild_seconds"] > 0
        for engine in fleet.engines:
            assert engine.policy_version == 2
            torch.testing.assert_close(engine.model.model.norm.weight, learner.model.norm.weight, rtol=0, atol=0)
    finally:
        sender.close()


def assert_holds(engine: ModelEngine, expected: dict[str, torch.Tensor]) -> None:
    for name, param in engine.model.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=0)


def test_tensors_sent_as_gathered_arrive_bit_identical_and_a_failed_update_keeps_the_old_weights(
    tmp_path: Path, tiny_model_dir: Path, fleet: Fleet
) -> None:
    # 0.03 MiB: the 128x128 projections travel straight from the learner's parameters, norms and biases
    # packed in runs between them; no scheduled snapshot, so a failed transfer has nothing to fall back on.
    cfg = _cfg(tmp_path, direct_tensor_mb=0.03, snapshot_every=0, transfer_timeout_s=3)
    learner = ModelEngine.from_path(make_tiny_model(tmp_path / "learner", hidden=128, layers=2, heads=4, seed=1)).model
    addresses = [fleet.add(tiny_model_dir, cfg) for _ in range(2)]
    sender = WeightSender(cfg, model=learner, servers=addresses)
    try:
        assert {s.direct for s in sender.segments} == {True, False}
        assert sender.publish(1)["weight_sync/reached"] == 2, sender.last_dropped
        v1 = {n: p.detach().clone() for n, p in learner.named_parameters()}
        for engine in fleet.engines:
            assert_holds(engine, v1)
            assert greedy(engine.model) == greedy(learner)

        with torch.no_grad():
            for p in learner.parameters():
                p.add_(torch.randn_like(p))

        def break_transfer(bucket: int, total: int) -> None:  # the group fails after the first bucket is on its way
            if bucket == 0:
                assert total > 1
                sender.transport._fail(RuntimeError("injected: the group broke"))

        sender.on_bucket = break_transfer
        metrics = sender.publish(2)
        sender.on_bucket = None
        assert metrics["weight_sync/reached"] == 0 and metrics["weight_sync/dropped"] == 2
        for engine in fleet.engines:  # all or nothing: still version 1, every byte of it, serving again
            assert engine.policy_version == 1 and engine.paused is None
            assert_holds(engine, v1)

        # The next update rebuilds the group; a background one sends the staged buckets, one with a
        # snapshot packs every tensor (the shard needs the whole bucket): the same bytes either way.
        sender.publish(3, background=True)
        assert sender.wait()["weight_sync/reached"] == 2, sender.last_dropped
        assert sender.publish(4, snapshot=True)["weight_sync/reached"] == 2, sender.last_dropped
        now = {n: p.detach() for n, p in learner.named_parameters()}
        for engine in fleet.engines:
            assert engine.policy_version == 4
            assert_holds(engine, now)
        version, path = latest_snapshot(snapshot_root(cfg))
        assert version == 4
        for name, tensor in read_snapshot(path):
            torch.testing.assert_close(tensor, now[name], rtol=0, atol=0)
    finally:
        sender.close()
