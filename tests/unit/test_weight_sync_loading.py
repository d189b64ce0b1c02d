"""Engines load their own weights: weight sync hands named tensors to an engine's ``load_weights`` and nothing else.

The recording engine here carries the attributes the old weight-sync targets reached into (``.model``,
``.llm``), each of which records any use: an update must arrive through the engine's method only, wired
the way the rollout server wires it (``rollout_server.control.load_receiver``). vLLM's delivery forwards
every stage to its workers (checked against a recording ``llm``; the real workers run in
tests/integration/test_weight_sync_vllm.py); SGLang's load goes through its own ``update_weights_from_tensor``.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch

from rollout_server.control import load_receiver
from rollout_server.engines import Chunk, Engine, SamplingSpec
from rollout_server.engines.base import Engine as BaseEngine
from tests.weight_receiver import ModelEngine
from tether.commands.tiny_model import make_tiny_model
from tether.config import TetherConfig
from tether.config.rollout import EngineConfig
from tether.v1 import control_pb2
from weight_sync.inbox import LocalDelivery
from weight_sync.loading import LoadResult, Tally
from weight_sync.receiver import WeightSyncError
from weight_sync.sender import WeightSender
from weight_sync.snapshot import snapshot_dir


class Recorder:
    """Records every attribute asked of it (and answers each with a coroutine that records its call)."""

    def __init__(self, results: dict | None = None) -> None:
        self.calls: list[tuple] = []
        self._results = results or {}

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        async def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            self.calls.append((name, args, kwargs))
            return self._results.get(name)

        return call


class ToyEngine(Engine):
    """Generation is beside the point; ``load_weights`` keeps what it was handed."""

    name = "toy"

    def __init__(self) -> None:
        self.model, self.llm = Recorder(), Recorder()  # where the old targets reached: must stay untouched
        self.loads: list[tuple[str, dict[str, torch.Tensor], dict]] = []
        self._paused = False

    async def load_weights(self, named, *, version: int, adoptable: bool = False) -> LoadResult:  # type: ignore[no-untyped-def]
        self.loads.append(("weights", {n: t.clone() for n, t in named}, {"version": version, "adoptable": adoptable}))
        return LoadResult()

    async def load_adapter(self, named, *, version: int, scale: float) -> LoadResult:  # type: ignore[no-untyped-def]
        self.loads.append(("adapter", {n: t.clone() for n, t in named}, {"version": version, "scale": scale}))
        return LoadResult()

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    async def stream(self, prompt_ids: list[int], spec: SamplingSpec, *, request_id: str) -> AsyncIterator[Chunk]:
        yield Chunk(0, [], [], [], finish_reason=1)

    async def abort(self, request_id: str) -> None:
        pass

    async def pause(self, inflight="keep") -> None:  # type: ignore[no-untyped-def]
        self._paused = True

    async def resume(self) -> None:
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused


class CannotLoad(ToyEngine):
    load_weights = BaseEngine.load_weights  # the base class' refusal
    load_adapter = BaseEngine.load_adapter


def _cfg(tmp_path: Path, **model) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "model": model,
            "weight_sync": {
                "transport": {"type": "filesystem", "path": str(tmp_path / "snaps")},
                "verify_checksums": True,
            },
        }
    )


def _publish(cfg: TetherConfig, model: torch.nn.Module, version: int, **sender) -> WeightSender:
    out = WeightSender(cfg, model=model, servers=[], **sender)
    out.publish(version)  # no servers: writes the snapshot only
    return out


def _plan(cfg: TetherConfig, sender: WeightSender, version: int) -> control_pb2.WeightUpdatePlan:
    path = snapshot_dir(Path(cfg.weight_sync.transport.path), version)
    return control_pb2.WeightUpdatePlan(
        version=version,
        tensors=sender.layout.tensors,
        buckets=sender.layout.buckets,
        update_id=f"u{version}",
        filesystem=control_pb2.FilesystemSource(path=str(path)),
    )


@pytest.fixture(scope="module")
def learner(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return ModelEngine.from_path(
        make_tiny_model(tmp_path_factory.mktemp("learner"), hidden=64, layers=1, heads=2)
    ).model


async def test_an_update_reaches_the_engine_only_through_its_load_method(tmp_path: Path, learner) -> None:
    cfg = _cfg(tmp_path)
    sender = _publish(cfg, learner, 1)
    engine = ToyEngine()
    receiver = load_receiver(SimpleNamespace(engine=engine, cfg=cfg))  # wired as the rollout server wires it
    assert isinstance(receiver.delivery, LocalDelivery)
    assert (await receiver.prepare(_plan(cfg, sender, 1))).ready and engine.paused
    done = await receiver.commit(control_pb2.CommitWeightUpdateRequest(update_id="u1", version=1))

    assert done.policy_version == engine.policy_version == 1 and not engine.paused
    ((kind, loaded, how),) = engine.loads
    assert kind == "weights" and how == {"version": 1, "adoptable": False}  # a snapshot's tensors: copy them
    expected = dict(learner.named_parameters())
    assert loaded.keys() == expected.keys()
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0)
        assert done.checksums[name] == pytest.approx(sender.last_checksums[name], rel=1e-12)
    assert done.bytes_received == sender.layout.num_bytes
    assert engine.model.calls == [] and engine.llm.calls == []  # nothing reached past the method


async def test_a_lora_update_goes_to_load_adapter_with_the_runs_scale(tmp_path: Path) -> None:
    from learner.lora import adapter_params, apply_lora

    cfg = _cfg(tmp_path, lora={"rank": 4, "alpha": 8})
    model_dir = make_tiny_model(tmp_path / "model", hidden=64, layers=1, heads=2)
    adapted = apply_lora(ModelEngine.from_path(model_dir).model, cfg.model.lora)
    params = adapter_params(adapted)
    sender = _publish(cfg, adapted, 1, params=params)
    engine = ToyEngine()
    receiver = load_receiver(SimpleNamespace(engine=engine, cfg=cfg))
    await receiver.prepare(_plan(cfg, sender, 1))
    await receiver.commit(control_pb2.CommitWeightUpdateRequest(update_id="u1", version=1))
    ((kind, loaded, how),) = engine.loads
    assert kind == "adapter" and how == {"version": 1, "scale": 2.0}  # alpha / rank
    assert loaded.keys() == {n for n, _ in params} and all(".lora_" in n for n in loaded)


async def test_an_engine_that_cannot_load_keeps_its_weights_and_says_why(tmp_path: Path, learner) -> None:
    cfg = _cfg(tmp_path)
    sender = _publish(cfg, learner, 1)
    engine = CannotLoad()
    receiver = load_receiver(SimpleNamespace(engine=engine, cfg=cfg))
    await receiver.prepare(_plan(cfg, sender, 1))
    with pytest.raises(WeightSyncError, match=r"rollout\.engine\.type=toy: this engine cannot load weight updates"):
        await receiver.commit(control_pb2.CommitWeightUpdateRequest(update_id="u1", version=1))
    assert engine.policy_version == 0 and not engine.paused  # serving again, on the weights it had


async def test_vllm_receives_and_loads_inside_its_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollout_server.engines.base import EngineError
    from rollout_server.engines.vllm_engine import WORKER_EXTENSION, VllmEngine, WorkerDelivery

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # engine_args() would set it for the whole process
    cfg = TetherConfig.model_validate(
        {"rollout": {"engine": {"type": "vllm"}}, "weight_sync": {"verify_checksums": True}}
    )
    engine = VllmEngine(cfg)
    assert engine.engine_args()["worker_extension_cls"] == WORKER_EXTENSION
    worker = {"bytes": 12, "checksums": {"w": 1.5}}
    engine.llm = Recorder({"collective_rpc": [worker, worker], "reset_prefix_cache": True})
    delivery = engine.weight_delivery(cfg)
    assert isinstance(delivery, WorkerDelivery)
    plan = control_pb2.WeightUpdatePlan(version=3, update_id="u3", filesystem=control_pb2.FilesystemSource(path="p"))
    await delivery.start(plan)
    assert await delivery.finish(plan, timeout_s=5) == Tally(12, {"w": 1.5})
    assert await delivery.load_snapshot(tmp_path, version=3) == Tally(12, {"w": 1.5})
    await delivery.cancel()
    wcfg = cfg.weight_sync
    go_timeout_s = wcfg.prepare_timeout_s + wcfg.transfer_timeout_s
    assert engine.llm.calls == [
        (
            "collective_rpc",
            ("tether_prepare",),
            {"args": (plan.SerializeToString(), wcfg.transfer_timeout_s, go_timeout_s, True, 0.0)},
        ),
        ("collective_rpc", ("tether_commit",), {"args": ("u3", 5, True, 0.0)}),
        ("update_weight_version", ("3",), {}),  # vLLM labels the tokens each version produces
        # Cached prefixes and the held requests' blocks hold the old weights' keys and values.
        ("reset_prefix_cache", (), {"reset_running_requests": True}),
        ("collective_rpc", ("tether_load_snapshot",), {"args": (str(tmp_path), True, 0.0)}),
        ("update_weight_version", ("3",), {}),
        ("reset_prefix_cache", (), {"reset_running_requests": True}),
        ("collective_rpc", ("tether_abort",), {"args": ()}),
    ]
    assert delivery.cache_resets == 2
    engine.llm._results["reset_prefix_cache"] = False  # vLLM kept its cache: the update must not pass
    with pytest.raises(EngineError, match="did not reset its prefix cache after loading version 3"):
        await delivery.load_snapshot(tmp_path, version=3)


async def test_sglang_loads_through_update_weights_from_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang cannot run here: its two names are stood in for, to check the call this engine makes."""
    from rollout_server.engines.sglang_engine import SglangEngine

    sent = []
    io_struct, utils = ModuleType("sglang.srt.managers.io_struct"), ModuleType("sglang.srt.utils")
    io_struct.UpdateWeightsFromTensorReqInput = lambda **kw: kw  # type: ignore[attr-defined]
    utils.MultiprocessingSerializer = SimpleNamespace(serialize=lambda tensors: list(tensors))  # type: ignore[attr-defined]
    for name, module in {"sglang": ModuleType("sglang"), "sglang.srt": ModuleType("sglang.srt"),
                         "sglang.srt.managers": ModuleType("sglang.srt.managers"),
                         "sglang.srt.managers.io_struct": io_struct, "sglang.srt.utils": utils}.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)

    async def update(request, _http_request):  # type: ignore[no-untyped-def]
        sent.append(request)
        return True, "ok"

    engine = SglangEngine(
        TetherConfig.model_validate({"rollout": {"engine": {"type": "sglang", "tensor_parallel_size": 2}}})
    )
    engine.llm = SimpleNamespace(tokenizer_manager=SimpleNamespace(update_weights_from_tensor=update))
    w = torch.ones(2, 3)
    assert await engine.load_weights(iter([("w", w)]), version=4, adoptable=True) == LoadResult(kept=False)
    ((request,),) = [sent]
    assert request["flush_cache"] is True and request["load_format"] is None
    assert request["serialized_named_tensors"] == [[("w", w)], [("w", w)]]  # one payload per TP rank


def test_every_engine_type_brings_its_own_loading() -> None:
    """No shipped engine falls back on the base class' refusal: each implements loading in its own file."""
    from rollout_server.engines.sglang_engine import SglangEngine
    from rollout_server.engines.transformers_engine import TransformersEngine
    from rollout_server.engines.vllm_engine import VllmEngine

    union = typing.get_args(typing.get_args(EngineConfig)[0])
    kinds = {typing.get_args(cls.model_fields["type"].annotation)[0] for cls in union}
    engines = {cls.name: cls for cls in (TransformersEngine, VllmEngine, SglangEngine)}
    assert set(engines) == kinds
    for cls in engines.values():
        own = cls.load_weights is not BaseEngine.load_weights or cls.weight_delivery is not BaseEngine.weight_delivery
        assert own, f"{cls.__name__} neither loads weights nor delivers them elsewhere"
