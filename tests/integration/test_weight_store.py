"""The store transport end to end in one process: a learner's ``StorePublisher`` (its origin chunk service on a
real port), servers' ``Puller``s (each with its own chunk service for peers) on a real Redis, loading into
real transformers models — versions published once, pulled through the fan-out tree, verified, swapped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis
import torch

from buffer import RedisKeys, ServerInfo, ServerRegistry
from buffer.weights import announce_weights, held_versions
from rollout_server.pull import SinkPeerDirectory
from rollout_server.sink import BufferSink
from tests.weight_receiver import ModelEngine
from tether.config import TetherConfig
from weight_sync.puller import Puller
from weight_sync.store import VersionStore
from weight_sync.store_publisher import StorePublisher

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _cfg(tmp_path: Path, redis_url: str, **ws) -> TetherConfig:
    transport = {"type": "store", "fanout": 1, "chunk_timeout_s": 5.0, "poll_s": 0.01, "chunk_mb": 0.25}
    transport |= {k: ws.pop(k) for k in ("base_every", "keep_versions", "chunk_mb") if k in ws}
    transport |= ws.pop("transport", {})
    return TetherConfig.model_validate({
        "run": {"run_id": "store", "output_dir": str(tmp_path / "runs")},
        "buffer": {"redis_url": redis_url},
        "weight_sync": {"transport": transport, "transfer_timeout_s": 20, "commit_timeout_s": 10} | ws,
    })  # fmt: skip


class Server:
    """A rollout server's weight side: a model, its puller, its Redis registration."""

    def __init__(self, cfg: TetherConfig, model_dir: Path, sid: str) -> None:
        self.engine = ModelEngine.from_path(model_dir)
        self.sink = BufferSink(cfg, sid)
        self.sink.registry.heartbeat(ServerInfo(sid, address=f"test:{sid}"), ttl_s=600)
        self.puller = Puller(self.engine, cfg, delivery=self.engine.weight_delivery(cfg),
                             fleet=SinkPeerDirectory(self.sink), server_id=sid)  # fmt: skip
        self.stop = asyncio.Event()
        self.task: asyncio.Task | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.puller.run(self.stop))

    async def close(self) -> None:
        self.stop.set()
        if self.task is not None:
            await self.task
        self.puller.close()
        self.sink.close()


def _learner(model_dir: Path, cfg: TetherConfig, client: redis.Redis) -> tuple[torch.nn.Module, StorePublisher]:
    keys = RedisKeys(cfg.run.run_id)
    registry = ServerRegistry(client, keys)
    model = ModelEngine.from_path(model_dir).model

    def fleet() -> dict[str, int]:
        live = [s.server_id for s in registry.live()]
        return {sid: h.version for sid, h in held_versions(client, keys, live).items()}

    sender = StorePublisher(cfg, model=model, announce=lambda info: announce_weights(client, keys, info), fleet=fleet)
    return model, sender


def _step(model: torch.nn.Module, seed: int, lr: float = 1e-6) -> None:
    """Something like an optimizer step at a small lr: a few elements move by a few ulps."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=g) < 0.03
            p.add_(mask * lr * torch.randn(p.shape, generator=g).sign())


def _same(model: torch.nn.Module, served: torch.nn.Module) -> None:
    theirs = dict(served.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(theirs[name], p, rtol=0, atol=0, msg=name)


async def _publish(sender: StorePublisher, version: int) -> dict[str, float]:
    return await asyncio.to_thread(sender.publish, version)


async def test_a_fleet_pulls_each_version_through_the_tree(tmp_path: Path, tiny_model_dir: Path, redis_url: str):
    cfg = _cfg(tmp_path, redis_url)
    client = redis.Redis.from_url(redis_url)
    model, sender = _learner(tiny_model_dir, cfg, client)
    servers = [Server(cfg, tiny_model_dir, f"s{i}") for i in range(3)]
    try:
        for s in servers:
            s.start()
        report = await _publish(sender, 0)  # the starting base every server fetches once
        assert report["weight_sync/reached"] == 3 and report["weight_sync/base"] == 1
        for v in range(1, 4):
            _step(model, v)
            origin_before = sender.origin.bytes_out()
            report = await _publish(sender, v)
            assert report["weight_sync/reached"] == 3, sender.last_dropped
            assert report["weight_sync/delta_ratio"] < 0.5  # a delta, not the whole model
            for s in servers:
                assert s.engine.policy_version == v
                _same(model, s.engine.model)
            # fanout 1: s0 fetches from the origin, s1 from s0, s2 from s1: the learner sends each delta once.
            sent = sender.origin.bytes_out() - origin_before
            assert sent == report["weight_sync/bytes"], (sent, report)
        assert servers[2].puller.bytes_by_kind.get("peer", 0) > 0
        assert "origin" not in servers[2].puller.bytes_by_kind or servers[2].puller.last.bytes_by_source.keys() == {
            f"peer:{servers[1].puller.peer_address}"
        }
    finally:
        for s in servers:
            await s.close()
        sender.close()
        client.close()


async def test_a_server_joining_at_v107_fetches_the_base_and_the_deltas_after_it(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
):
    cfg = _cfg(tmp_path, redis_url, base_every=20, keep_versions=30)
    client = redis.Redis.from_url(redis_url)
    model, sender = _learner(tiny_model_dir, cfg, client)
    try:
        for v in range(0, 108):
            if v:
                _step(model, v)
            await _publish(sender, v)  # no server yet: nothing to wait for
        store = VersionStore(cfg.run.output_dir + "/store/weights")
        assert "base" in store.kinds(100) and "base" not in store.kinds(107)
        joiner = Server(cfg, tiny_model_dir, "late")
        try:
            await joiner.puller.pull(await joiner.puller.fleet.announced())
            assert joiner.engine.policy_version == 107
            assert joiner.puller.last.chain == ("v100.base", *(f"v{v}.delta" for v in range(101, 108)))
            _same(model, joiner.engine.model)
        finally:
            await joiner.close()
    finally:
        sender.close()
        client.close()


async def test_a_chunk_corrupt_on_disk_is_never_applied(tmp_path: Path, tiny_model_dir: Path, redis_url: str):
    """A byte flipped in the store: the origin serves it, the puller refuses it (no other source), keeps
    serving its weights, and pulls the version once the store is whole again."""
    cfg = _cfg(tmp_path, redis_url)
    client = redis.Redis.from_url(redis_url)
    model, sender = _learner(tiny_model_dir, cfg, client)
    server = Server(cfg, tiny_model_dir, "only")
    try:
        await _publish(sender, 0)
        await server.puller.pull(await server.puller.fleet.announced())
        before = {n: p.clone() for n, p in server.engine.model.named_parameters()}
        _step(model, 1)
        sender.wcfg = sender.wcfg.model_copy(update={"transfer_timeout_s": 0.1, "commit_timeout_s": 0.1})
        await _publish(sender, 1)
        store = VersionStore(cfg.run.output_dir + "/store/weights")
        changed = max(store.manifest(1, "delta").chunks, key=lambda c: c.size)
        path = store.chunk_path(changed.hash)
        good = path.read_bytes()
        path.write_bytes(good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 0x40]) + good[len(good) // 2 + 1 :])
        with pytest.raises(Exception, match="hash"):
            await server.puller.pull(await server.puller.fleet.announced())
        assert server.engine.policy_version == 0
        for n, p in server.engine.model.named_parameters():
            torch.testing.assert_close(p, before[n], rtol=0, atol=0, msg=n)
        path.write_bytes(good)
        await server.puller.pull(await server.puller.fleet.announced())
        assert server.engine.policy_version == 1
        _same(model, server.engine.model)
    finally:
        await server.close()
        sender.close()
        client.close()


async def test_a_peer_gone_mid_transfer_sends_its_child_to_the_origin(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str
):
    """fanout 1: s1 fetches from s0 first. s0's chunk service stops after s1 got its first chunk of a base:
    s1 finishes from the origin, bit-exact, and names s0 among the sources that failed."""
    cfg = _cfg(tmp_path, redis_url, chunk_mb=0.1)
    client = redis.Redis.from_url(redis_url)
    model, sender = _learner(tiny_model_dir, cfg, client)
    parent, child = Server(cfg, tiny_model_dir, "s0"), Server(cfg, tiny_model_dir, "s1")
    try:
        await _publish(sender, 0)
        await parent.puller.pull(await parent.puller.fleet.announced())  # s0 holds v0: serves its base chunks
        got = []

        def cut_after_first(digest: str, data: bytes) -> None:
            got.append(digest)
            if len(got) == 1:
                parent.puller.service.stop(0)

        child.puller.chunks.cache.put = cut_after_first  # the fetch's on_chunk hook: sees each verified chunk
        await child.puller.pull(await child.puller.fleet.announced())
        stats = child.puller.last
        assert len(got) == len(stats.manifests[0].chunks) > 3
        assert any(name.startswith("peer:") for name in stats.failed_sources), stats.failed_sources
        assert {name.split(":", 1)[0] for name in stats.bytes_by_source} == {"peer", "origin"}
        assert child.engine.policy_version == 0
        _same(model, child.engine.model)
    finally:
        await parent.close()
        await child.close()
        sender.close()
        client.close()


_DIES_MID_PUBLISH = """
import os, sys, torch
from weight_sync.store import VersionWriter, VersionStore
store = VersionStore(sys.argv[1])
pub = VersionWriter(store, dtype="float32", base_every=10, chunk_bytes=1 << 16)
g = torch.Generator().manual_seed(0)
named = {"w": torch.randn(64, 1024, generator=g), "b": torch.randn(1024, generator=g)}
pub.publish(0, named)
named["w"][:3] += 1.0
pub.publish(1, named)
named["w"][5:9] += 1.0
store._write_manifest = lambda m: os._exit(9)  # killed after v2's chunks, before its manifest
pub.publish(2, named)
"""


def test_a_learner_killed_before_the_manifest_leaves_no_version(tmp_path: Path):
    """Chunks are written first and the manifest last, so a learner killed in between leaves v2 invisible:
    the newest readable version is v1, bit-exact, and the orphan chunks go at the next prune."""
    import subprocess
    import sys

    from weight_sync.sources import DirSource, Fetcher, ProviderSource

    root = tmp_path / "weights"
    proc = subprocess.run([sys.executable, "-c", _DIES_MID_PUBLISH, str(root)], capture_output=True, text=True)
    assert proc.returncode == 9, proc.stderr
    store = VersionStore(root)
    assert store.versions() == [0, 1]
    named = [c for v in (0, 1) for kind in store.kinds(v) for c in store.manifest(v, kind).chunks]
    on_disk = {p.name for p in (root / "chunks").rglob("*") if p.is_file()}
    assert on_disk - {c.hash for c in named}  # v2's chunks are there, named by no manifest
    weights, _ = Fetcher([ProviderSource(DirSource(root))]).fetch(None)
    assert weights.version == 1
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(64, 1024, generator=g), torch.randn(1024, generator=g)
    w[:3] += 1.0
    got = weights.named_tensors()
    torch.testing.assert_close(got["w"], w, rtol=0, atol=0)
    torch.testing.assert_close(got["b"], b, rtol=0, atol=0)
    store.prune(keep=2)
    on_disk = {p.name for p in (root / "chunks").rglob("*") if p.is_file()}
    assert on_disk == {c.hash for c in named}
