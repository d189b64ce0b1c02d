"""What the vLLM engine tells its workers about weight updates, and what it refuses at startup (no vLLM run).

A collective update of full weights is loaded in the workers while it arrives, before Commit, so whether it
reports checksums and whether it is a LoRA update must travel with Prepare, from the run's config (never
guessed from tensor names). An engine of several workers cannot join a collective weight group (every
worker would take the server's one rank): the engine refuses that configuration before vLLM loads anything.
"""

from __future__ import annotations

import sys

import pytest
import torch

from rollout_server.engines import vllm_engine
from rollout_server.engines.base import EngineError
from rollout_server.engines.vllm_engine import VllmEngine, WorkerDelivery, check_weight_transport
from rollout_server.engines.vllm_worker import WeightSyncWorker
from tether.config import TetherConfig
from tether.v1 import control_pb2
from weight_sync.buckets import plan_layout


def _cfg(transport: str = "filesystem", *, tensor_parallel_size: int = 1, **extra: object) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "rollout": {"engine": {"type": "vllm", "tensor_parallel_size": tensor_parallel_size}},
            "weight_sync": {"transport": {"type": transport}, **extra.pop("weight_sync", {})},  # type: ignore[dict-item]
            **extra,
        }
    )


@pytest.mark.parametrize("transport", ["nccl", "gloo"])
def test_a_collective_transport_with_tensor_parallelism_is_refused_at_startup(transport: str) -> None:
    with pytest.raises(EngineError, match=r"tensor_parallel_size 2.*filesystem or store"):
        check_weight_transport(_cfg(transport, tensor_parallel_size=2))
    check_weight_transport(_cfg(transport, tensor_parallel_size=1))


@pytest.mark.parametrize("transport", ["filesystem", "store"])
def test_transports_each_worker_reads_alone_start_with_tensor_parallelism(transport: str) -> None:
    check_weight_transport(_cfg(transport, tensor_parallel_size=4))


async def test_the_engine_start_refuses_before_vllm_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:  # the engine checks that vLLM is installed; it need not be here
        m.setattr(vllm_engine.importlib.util, "find_spec", lambda name: object())
        engine = VllmEngine(_cfg("nccl", tensor_parallel_size=2))
    for name in ("vllm", "vllm.engine.arg_utils", "vllm.v1.engine.async_llm"):
        monkeypatch.setitem(sys.modules, name, None)  # any import of vLLM would raise ImportError, not EngineError
    with pytest.raises(EngineError, match="every worker would join"):
        await engine.start()
    assert engine.llm is None


class _Llm:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append((method, args))
        return [True]


@pytest.mark.parametrize(
    ("extra", "sums", "scale"),
    [
        ({}, False, 0.0),
        ({"weight_sync": {"verify_checksums": True}}, True, 0.0),
        ({"model": {"lora": {"rank": 4, "alpha": 8.0}}}, False, 2.0),
    ],
)
async def test_prepare_carries_the_checksum_and_lora_settings(extra: dict, sums: bool, scale: float) -> None:
    cfg = _cfg("gloo", **extra)
    llm = _Llm()
    plan = control_pb2.WeightUpdatePlan(version=1, update_id="u1")
    await WorkerDelivery(llm, cfg).start(plan)
    wcfg = cfg.weight_sync
    go_timeout_s = wcfg.prepare_timeout_s + wcfg.transfer_timeout_s
    assert llm.calls == [
        ("tether_prepare", (plan.SerializeToString(), wcfg.transfer_timeout_s, go_timeout_s, sums, scale))
    ]


class _Inbox:
    """Records whether an update was streamed into the model or received whole for Commit."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def stream(self, plan, **kw) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("stream")

    def start(self, plan, **kw) -> None:  # type: ignore[no-untyped-def]
        self.calls.append("start")


class _Worker(WeightSyncWorker):
    def __init__(self) -> None:
        self.vllm_config = type("C", (), {"parallel_config": type("P", (), {"tensor_parallel_size": 1})()})()
        self.device = torch.device("cpu")
        self._tether_inbox_state = _Inbox()


def _collective_plan(names: list[str]) -> bytes:
    layout = plan_layout([(name, torch.float32, (4,)) for name in names], bucket_size_bytes=1 << 10)
    source = control_pb2.CollectiveSource(
        backend="gloo", init_method="tcp://127.0.0.1:1", world_size=2, rank=1, group_epoch=1
    )
    return control_pb2.WeightUpdatePlan(
        version=1, update_id="u1", tensors=layout.tensors, buckets=layout.buckets, collective=source
    ).SerializeToString()


def test_the_lora_setting_not_the_tensor_names_says_an_update_is_adapters() -> None:
    adapter_names = ["q_proj.lora_A.weight", "q_proj.lora_B.weight"]
    cases = [(["w"], 0.0, "stream"), (adapter_names, 0.0, "stream"), (["w"], 2.0, "start")]
    for names, scale, expected in cases:
        worker = _Worker()
        worker.tether_prepare(_collective_plan(names), 1.0, 0.5, False, scale)
        assert worker._tether_inbox_state.calls == [expected], (names, scale)
