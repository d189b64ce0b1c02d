"""docs/EXTENDING.md's recipes, each done once: a toy engine (generating, and loading weight updates), a toy
weight transport, a toy place to pull weights from, a toy policy loss, a toy advantage estimator.

The engine is one class implementing :class:`rollout_server.engines.Engine` (only ``stream`` does real
work); a real prompt worker drives it and its samples land in a real Redis buffer with their log-probs and
per-token versions. Its ``load_weights`` is the whole of its weight loading: a real learner-side sender
publishes over the filesystem and gloo transports to the rollout server's own Control servicer wired to
it, and the toy ends up holding the learner's exact tensors at the new version. The transport is two
classes, the sender's end and the receiver's, and moves an update to an engine it knows nothing of. The
place to pull from is one class and one registry line: a real store publisher's versions, synced into an
in-memory mirror, reach a real puller that can reach nothing else, bit for bit, and a chunk it corrupts
is refused by its hash.
The loss is one function and one config class (its knob validated at load time), the estimator one
function declaring what it needs (its name validated at load time), each in its registry; a real trainer
step (tiny model, one gloo rank) must call them: the loss scaled by its knob gives exactly scaled
gradients, and an estimator that returns zero advantages gives zero policy gradients.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import ClassVar, Literal
from urllib.parse import urlsplit

import pytest
import redis
import torch
import torch.distributed as dist
import yaml
from pydantic import Field
from torch.testing import assert_close

from buffer import PromptQueue, TrajectoryReader
from rollout_server.engines import Chunk, Engine, SamplingSpec
from tether.config import ConfigError, load_config, save_resolved
from tether.config.rollout import EngineSection
from tether.redis_server import free_port
from tether.v1 import trajectory_pb2
from weight_sync.loading import LoadResult
from weight_sync.mirrors import LayoutMirror
from weight_sync.versions import ChunkCorrupt


class CountingEngineConfig(EngineSection):
    """The toy's config class (in the engine union of ``tether/config/rollout.py`` for a real engine): its
    type, and what it can do."""

    type: Literal["counting"] = "counting"
    shares_base: ClassVar[bool] = False

    def uses_gpu(self, gpus: int) -> bool:
        return False


class CountingEngine(Engine):
    """Answers every sample with the tokens 10, 11, ... (``max_tokens`` of them), log-prob -0.5 each; its
    "model" is the tensors of the last weight update it loaded."""

    name = "counting"
    max_model_len = 4096

    def __init__(self, cfg, *, named_adapters: bool = False) -> None:  # type: ignore[no-untyped-def]
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self._paused = False
        self.weights: dict[str, torch.Tensor] = {}
        self.loads: list[dict] = []

    async def load_weights(self, named, *, version: int, adoptable: bool = False) -> LoadResult:  # type: ignore[no-untyped-def]
        # Copies, so the receive buffers are not kept (an engine that adopts them answers kept=True).
        self.weights = {name: tensor.clone() for name, tensor in named}
        self.loads.append({"version": version, "adoptable": adoptable})
        return LoadResult(kept=False)

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        for index in range(spec.n):
            tokens = list(range(10, 10 + spec.max_tokens))
            yield Chunk(index, tokens, [-0.5] * len(tokens), [self.policy_version] * len(tokens), finish_reason=2)

    async def abort(self, request_id: str) -> None:
        pass

    async def pause(self, inflight="keep") -> None:  # type: ignore[no-untyped-def]
        self._paused = True

    async def resume(self) -> None:
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused


async def test_a_new_engine_is_one_class(
    tiny_model_dir: Path, redis_url: str, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollout_server.engines import ENGINES, build_engine
    from rollout_server.metrics import ServerMetrics
    from rollout_server.sink import BufferSink
    from rollout_server.state import ServerState
    from rollout_server.worker import PromptWorker

    cfg = load_config(
        None,
        ["--model.path", str(tiny_model_dir), "--run.run_id", f"ext-{uuid.uuid4().hex[:6]}",
         "--buffer.redis_url", redis_url, "--rollout.n", "3", "--rollout.max_tokens", "5",
         "--rollout.reward", "{type: exact_match}"],
    )  # fmt: skip
    # --- the recipe's one registration: build_engine then finds it by its config's type.
    monkeypatch.setitem(ENGINES, "counting", f"{__name__}:CountingEngine")
    cfg = cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": CountingEngineConfig()})})
    engine = build_engine(cfg)
    assert isinstance(engine, CountingEngine)
    engine.policy_version = 7
    state = ServerState(cfg, engine, "rollout-toy", ServerMetrics("rollout-toy"), sink=BufferSink(cfg, "toy"))
    keys = state.sink.keys
    prompt = trajectory_pb2.Prompt(prompt_id="p0", text="count:", reward_context={"answer": "x"})
    PromptQueue(redis_client, keys).feed(iter([prompt]), version=7, prompts_per_version=1, max_staleness=0)
    task = asyncio.create_task(PromptWorker(state).run())
    reader = TrajectoryReader(redis_client, keys, cfg.buffer, consumer="learner-0")
    try:
        got = []
        for _ in range(100):
            got = await asyncio.to_thread(reader.read, 1, current_version=7, max_staleness=0, block_ms=200)
            if got or task.done():
                break
        if task.done():
            task.result()
    finally:
        state.draining = True
        await asyncio.wait_for(task, 30)
        state.sink.close()
    (buffered,) = got
    trajectories = buffered.group.trajectories
    assert len(trajectories) == 3
    for t in trajectories:
        assert t.completion_token_ids.tolist() == [10, 11, 12, 13, 14]
        assert t.behavior_logprobs.tolist() == pytest.approx([-0.5] * 5)
        assert t.policy_versions.tolist() == [7] * 5


def _weights_cfg(tmp_path: Path, model_dir: Path, transport: dict, **weight_sync: object):  # type: ignore[no-untyped-def]
    section = {
        **weight_sync,
        "transport": transport,
        "verify_checksums": True,
        "bucket_size_mb": 0.25,
        "prepare_timeout_s": 10,
        "transfer_timeout_s": 20,
        "commit_timeout_s": 20,
    }
    return load_config(
        None,
        ["--model.path", str(model_dir), "--run.run_id", f"ext-{uuid.uuid4().hex[:6]}",
         "--run.output_dir", str(tmp_path), "--weight_sync", yaml.safe_dump(section, default_flow_style=True)],
    )  # fmt: skip


async def _publish_to(engine: Engine, cfg, learner: torch.nn.Module, version: int) -> dict:  # type: ignore[no-untyped-def]
    """One update from a real sender to the rollout server's Control servicer around ``engine``."""
    import grpc

    from rollout_server.control import ControlServicer
    from rollout_server.metrics import ServerMetrics
    from rollout_server.state import ServerState
    from tether.v1 import control_pb2_grpc
    from weight_sync.sender import WeightSender

    server = grpc.aio.server()
    state = ServerState(cfg, engine, "rollout-toy", ServerMetrics("rollout-toy"))
    control_pb2_grpc.add_ControlServicer_to_server(ControlServicer(state), server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    sender = WeightSender(cfg, model=learner, servers=[address])
    try:
        metrics = await asyncio.to_thread(sender.publish, version)
        assert metrics["weight_sync/reached"] == 1, sender.last_dropped  # checksums compared, too
        return metrics
    finally:
        sender.close()
        await server.stop(None)


@pytest.mark.parametrize("transport", [{"type": "filesystem"}, {"type": "gloo", "master_port": 0}])
async def test_a_new_engine_loads_weight_updates_with_one_method(
    tmp_path: Path, tiny_model_dir: Path, transport: dict
) -> None:
    from transformers import AutoModelForCausalLM

    cfg = _weights_cfg(tmp_path, tiny_model_dir, transport)
    engine = CountingEngine(cfg)
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(1.5)
    await _publish_to(engine, cfg, learner, 1)
    assert engine.policy_version == 1 and not engine.paused
    # Received buckets may be adopted; a snapshot read from disk may not.
    assert engine.loads == [{"version": 1, "adoptable": transport["type"] == "gloo"}]
    expected = dict(learner.named_parameters())
    assert engine.weights.keys() == expected.keys()
    for name, tensor in engine.weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)


async def test_a_new_transport_is_a_sender_and_a_receiver(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A toy transport — each segment a file of raw bytes — moves an update to the toy engine above.

    Its two classes stand where docs/EXTENDING.md puts a transport's: the sender's end (what
    ``make_sender_transport`` returns) and the receiver's end (an entry in ``weight_sync.inbox.SOURCES``).
    A test cannot add a field to the plan's ``source`` oneof (control.proto), so the toy addresses its
    folder with the filesystem source's message and takes that entry's place for the test.
    """
    from transformers import AutoModelForCausalLM

    from tether.v1 import control_pb2
    from weight_sync import inbox, sender
    from weight_sync.buckets import Layout, empty_bucket, plan_segments, unpack
    from weight_sync.transport import SenderTransport

    class RawFilesSender(SenderTransport):
        name = "raw-files"

        def __init__(self, root: Path) -> None:
            self.root, self.folder, self.sent = root, root, 0

        def sources(self, servers, *, version):  # type: ignore[no-untyped-def]
            self.folder, self.sent = self.root / f"v{version}", 0
            self.folder.mkdir(parents=True)
            return {s: {"filesystem": control_pb2.FilesystemSource(path=str(self.folder))} for s in servers}

        def send(self, flat, *, on_done=None):  # type: ignore[no-untyped-def]
            (self.folder / f"{self.sent:05d}.bin").write_bytes(flat.cpu().numpy().tobytes())
            self.sent += 1
            if on_done is not None:
                on_done()

    class RawFilesReceiver(inbox.SourceReceiver):
        def take(self, plan, *, timeout_s):  # type: ignore[no-untyped-def]
            layout = Layout.from_plan(plan)
            flats = [empty_bucket(bucket) for bucket in plan.buckets]
            for i, seg in enumerate(plan_segments(layout, min_bytes=0)):  # the order the sender sent them in
                data = (Path(plan.filesystem.path) / f"{i:05d}.bin").read_bytes()
                flats[seg.bucket][seg.start : seg.end] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            named = [
                pair for flat, group in zip(flats, layout.bucket_members(), strict=True) for pair in unpack(flat, group)
            ]
            return inbox.Incoming(named, on_kept=lambda: None)  # fresh buffers: an engine may keep them

    root = tmp_path / "raw"
    monkeypatch.setattr(sender, "make_sender_transport", lambda cfg, *, snapshot_root: RawFilesSender(root))
    monkeypatch.setitem(inbox.SOURCES, "filesystem", RawFilesReceiver)
    cfg = _weights_cfg(
        tmp_path, tiny_model_dir, {"type": "filesystem"}, snapshot_every=0
    )  # no snapshot to fall back on
    engine = CountingEngine(cfg)
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.25)
    await _publish_to(engine, cfg, learner, 1)
    assert sorted(root.glob("v1/*.bin")) and not list(tmp_path.rglob("model.safetensors.index.json"))
    assert engine.policy_version == 1 and engine.loads == [{"version": 1, "adoptable": True}]
    for name, param in learner.named_parameters():
        torch.testing.assert_close(engine.weights[name], param, rtol=0, atol=0)


class InMemoryMirror(LayoutMirror):
    """A toy place to pull versions from: the store's files held in memory, as an object-store bucket the
    store is synced to would hold them, counting what it served. Built by the puller from ``toy://<bucket>``."""

    buckets: ClassVar[dict[str, dict[str, bytes]]] = {}
    """Bucket -> the store's files by their path in the layout (``chunks/ab/<hash>``): what the test syncs."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.files = self.buckets[urlsplit(url).netloc]
        self.served: Counter[str] = Counter()

    def read(self, path: str, *, timeout_s: float) -> bytes | None:
        data = self.files.get(path)
        if data is not None:
            self.served[path.split("/", 1)[0]] += 1  # "manifests" or "chunks"
        return data


def _sync(root: Path, bucket: dict[str, bytes]) -> None:
    """What ``aws s3 sync`` would do after each publication: the store's files into the bucket."""
    bucket.clear()
    bucket.update({p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()})


async def test_a_new_place_to_pull_from_is_one_class(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fleet that reaches neither the learner nor its store pulls each version from the toy mirror: a real
    ``StorePublisher`` writes the store, the test syncs it into the toy's bucket, a real ``Puller`` (the
    toy engine above loading) fetches from ``toy://bucket`` alone — bit for bit, and a chunk the mirror
    corrupts is refused by its hash."""
    from transformers import AutoModelForCausalLM

    from buffer import RedisKeys
    from buffer.weights import announce_weights
    from rollout_server.pull import SinkPeerDirectory
    from rollout_server.sink import BufferSink
    from weight_sync import mirrors
    from weight_sync.puller import Puller
    from weight_sync.store import VersionStore, chunk_name
    from weight_sync.store_publisher import StorePublisher, store_root

    # --- the recipe's one registration: the puller builds an InMemoryMirror for each toy:// URL it is given.
    monkeypatch.setitem(mirrors.MIRRORS, "toy", f"{__name__}:InMemoryMirror")
    bucket: dict[str, bytes] = {}
    monkeypatch.setitem(InMemoryMirror.buckets, "bucket", bucket)
    transport = {"type": "store", "fanout": 0, "chunk_mb": 0.25, "mirrors": ["toy://bucket"]}
    cfg = load_config(
        None,
        ["--model.path", str(tiny_model_dir), "--run.run_id", f"ext-{uuid.uuid4().hex[:6]}",
         "--run.output_dir", str(tmp_path), "--buffer.redis_url", redis_url,
         "--weight_sync", yaml.safe_dump({"transport": transport}, default_flow_style=True)],
    )  # fmt: skip
    assert not cfg.weight_sync.transport.shared  # the store is not mounted on the server
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys(cfg.run.run_id)
    learner = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    # The announcement names no origin: the fleet cannot reach the learner's chunk service.
    publisher = StorePublisher(
        cfg, model=learner, announce=lambda info: announce_weights(client, keys, info | {"origin": ""})
    )
    engine = CountingEngine(cfg)
    sink = BufferSink(cfg, "s0")
    puller = Puller(engine, cfg, delivery=engine.weight_delivery(cfg), fleet=SinkPeerDirectory(sink), server_id="s0")
    root = store_root(cfg)
    try:
        (mirror,) = puller.mirrors
        assert isinstance(mirror, InMemoryMirror) and mirror.name == "mirror:toy://bucket"

        def same_as_learner() -> None:
            expected = dict(learner.named_parameters())
            assert engine.weights.keys() == expected.keys()
            for name, tensor in engine.weights.items():
                torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)

        await asyncio.to_thread(publisher.publish, 0)
        _sync(root, bucket)
        await puller.pull(await puller.fleet.announced())
        assert engine.policy_version == 0 and puller.last.chain == ("v0.base",)
        same_as_learner()
        assert mirror.served["chunks"] == len(puller.last.manifests[0].chunks) and mirror.served["manifests"]
        v0 = {name: tensor.clone() for name, tensor in engine.weights.items()}

        with torch.no_grad():
            next(learner.parameters())[:3].add_(0.25)
        await asyncio.to_thread(publisher.publish, 1)
        _sync(root, bucket)
        delta = VersionStore(root).manifest(1, "delta")
        # The mirror's copy of v1's biggest chunk has a byte flipped: refused by its hash, never decoded.
        bad = chunk_name(max(delta.chunks, key=lambda c: c.size).hash)
        good = bucket[bad]
        bucket[bad] = good[:-1] + bytes([good[-1] ^ 0x01])
        with pytest.raises(ChunkCorrupt, match="mirror:toy://bucket: bytes fail their hash"):
            await puller.pull(await puller.fleet.announced())
        assert engine.policy_version == 0
        for name, tensor in engine.weights.items():
            torch.testing.assert_close(tensor, v0[name], rtol=0, atol=0, msg=name)
        bucket[bad] = good
        before = mirror.served["chunks"]
        await puller.pull(await puller.fleet.announced())
        assert engine.policy_version == 1 and puller.last.chain == ("v1.delta",)
        same_as_learner()

        # Every byte came from the toy: one read per chunk applied, no other source asked, nothing from the learner.
        assert mirror.served["chunks"] - before == len(delta.chunks)
        assert puller.last.bytes_by_source.keys() == {mirror.name} and not puller.last.failed_sources
        assert set(puller.bytes_by_kind) == {"mirror"} and publisher.origin.bytes_out() == 0
    finally:
        puller.close()
        sink.close()
        publisher.close()
        client.close()


@pytest.fixture(scope="module")
def one_rank() -> Iterator[None]:
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _first_grads(model_dir: Path, algorithm: dict | None = None) -> dict[str, torch.Tensor]:
    """The first update's gradients of a fresh trainer on fixed synthetic groups (no clipping in reach);
    ``algorithm`` goes through the config's validation, a registered toy's name included."""
    from learner.parallelize import load_model
    from learner.synthetic import make_groups
    from learner.trainer import Trainer

    cfg = load_config(
        None,
        ["--model.path", str(model_dir), "--rollout.max_tokens", "24",
         "--learner", "{train_batch_size: 4, lr: 1e-2, lr_warmup_steps: 0, grad_clip: 1e9, use_dynamic_bsz: false,"
                      " micro_batch_size_per_gpu: 4}",
         "--algorithm", yaml.safe_dump({"max_staleness": 1, **(algorithm or {})}, default_flow_style=True)],
    )  # fmt: skip
    torch.manual_seed(0)
    model = load_model(cfg, torch.device("cpu"))
    trainer = Trainer(cfg, model, device=torch.device("cpu"), ref_model=None)
    grads: dict[str, torch.Tensor] = {}

    def keep(*_) -> None:  # type: ignore[no-untyped-def]
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})

    trainer.optimizer.register_step_pre_hook(keep)
    trainer.train_step(make_groups(4, 4, vocab=256, seed=0), version=1)
    return grads


def test_a_new_policy_loss_is_one_function_and_one_config_class(
    one_rank, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from learner import losses
    from tether.config import policy_loss as loss_configs

    # Both registries are module-level: this test's entries leave with it.
    monkeypatch.setattr(losses, "POLICY_LOSSES", dict(losses.POLICY_LOSSES))
    monkeypatch.setattr(loss_configs, "POLICY_LOSS_CONFIGS", dict(loss_configs.POLICY_LOSS_CONFIGS))
    calls = []

    # --- the recipe: one config class ...
    @loss_configs.register_policy_loss_config
    class ScaledLoss(loss_configs.PolicyLossConfig):
        """PPO-clip, scaled."""

        loss_mode: Literal["scaled"] = "scaled"
        scale: float = Field(default=1.0, gt=0)
        """What the vanilla loss is multiplied by."""

    # --- ... and one function.
    @losses.register_policy_loss("scaled")
    def scaled(inputs: losses.PolicyLossInputs, settings):  # type: ignore[no-untyped-def]
        calls.append(settings.policy_loss)
        loss, metrics = losses.policy_loss(inputs, settings)
        return settings.policy_loss.scale * loss, metrics

    # Its knobs are validated at load time, under the key the user wrote.
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss\.scale: Input should be greater than 0"):
        load_config(None, ["--algorithm.policy_loss", "{loss_mode: scaled, scale: -1}"])
    with pytest.raises(ConfigError, match=r"algorithm\.policy_loss\.scael: unknown key — did you mean 'scale'"):
        load_config(None, ["--algorithm.policy_loss", "{loss_mode: scaled, scael: 3}"])
    # The resolved config a run writes reads back as the same loss with the same knobs.
    cfg = load_config(None, ["--algorithm.policy_loss", "{loss_mode: scaled, scale: 3}"])
    again = load_config(save_resolved(cfg, tmp_path))
    assert again == cfg and isinstance(again.algorithm.policy_loss, ScaledLoss)

    base = _first_grads(tiny_model_dir)
    toy = _first_grads(tiny_model_dir, {"policy_loss": {"loss_mode": "scaled", "scale": 3.0}})
    assert calls and all(c == ScaledLoss(scale=3.0) for c in calls)
    assert base.keys() == toy.keys()
    for name in base:
        assert_close(toy[name], 3 * base[name], rtol=1e-4, atol=1e-7)


def test_a_new_estimator_is_one_function(one_rank, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from learner import advantages
    from tether.config import adv_estimator

    # Both registries are module-level: this test's entries leave with it.
    monkeypatch.setattr(advantages, "ESTIMATORS", dict(advantages.ESTIMATORS))
    monkeypatch.setattr(adv_estimator, "ADV_ESTIMATORS", dict(adv_estimator.ADV_ESTIMATORS))

    # --- the recipe: one function, registered with what it needs (here nothing but the rewards).
    @advantages.register_adv_est("nothing")
    def nothing(batch, cfg):  # type: ignore[no-untyped-def]
        zeros = torch.zeros_like(batch.token_rewards)
        return zeros, zeros

    base = _first_grads(tiny_model_dir)
    toy = _first_grads(tiny_model_dir, {"adv_estimator": "nothing", "entropy_coeff": 0.0})
    assert any(g.abs().max() > 0 for g in base.values())  # the real estimator moves the weights
    assert all(g.abs().max() == 0 for g in toy.values())  # zero advantages, no entropy/KL term: no gradient
