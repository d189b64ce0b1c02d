"""Weight-target dispatch follows ``rollout.engine.type``, never the engine object's attributes.

The engines here are stand-ins with the attributes the old attribute check looked at (``.llm``,
``.model``), and an ``llm`` that records every call: an SGLang-typed engine must never reach vLLM's
worker RPCs (``collective_rpc``, ``reset_prefix_cache``), whatever it carries.
"""

from __future__ import annotations

import typing
from types import SimpleNamespace

import grpc
import pytest

from rollout_server.control import load_receiver
from rollout_server.validation import BadRequest
from tether.config import TetherConfig
from tether.config.rollout import EngineConfig
from weight_sync.receiver import WeightReceiver
from weight_sync.targets import TARGETS, UNAVAILABLE, ModuleTarget, TargetUnavailable, VllmTarget, make_target


class RecordingLlm:
    """Records every attribute asked of it: a call to any of vLLM's worker RPCs would show here."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        self.calls.append(name)

        async def rpc(*args, **kwargs) -> list:
            return []

        return rpc


def _cfg(kind: str) -> TetherConfig:
    return TetherConfig.model_validate({"rollout": {"engine": {"type": kind}}})


def _engine(kind: str) -> SimpleNamespace:
    # Both attributes the old check looked at, so only the configured type can decide.
    return SimpleNamespace(name=kind, llm=RecordingLlm(), model=object(), policy_version=0)


def test_sglang_typed_engine_never_reaches_vllm_rpcs() -> None:
    engine = _engine("sglang")
    with pytest.raises(TargetUnavailable, match=r"rollout\.engine\.type=sglang"):
        make_target(engine, _cfg("sglang"))
    with pytest.raises(TargetUnavailable):
        WeightReceiver(engine, _cfg("sglang"))
    # The rollout server answers weight-update RPCs UNIMPLEMENTED with the reason, and keeps serving.
    with pytest.raises(BadRequest) as refused:
        load_receiver(SimpleNamespace(engine=engine, cfg=_cfg("sglang")))
    assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED and "sglang" in str(refused.value)
    assert engine.llm.calls == []


def test_dispatch_is_by_configured_type() -> None:
    assert isinstance(make_target(_engine("vllm"), _cfg("vllm")), VllmTarget)
    assert isinstance(make_target(_engine("transformers"), _cfg("transformers")), ModuleTarget)
    with pytest.raises(TypeError, match=r"rollout\.engine\.type is 'transformers' but the engine is 'vllm'"):
        make_target(_engine("vllm"), _cfg("transformers"))


def test_every_engine_type_has_a_target_or_a_reason() -> None:
    union = typing.get_args(typing.get_args(EngineConfig)[0])
    kinds = {typing.get_args(cls.model_fields["type"].annotation)[0] for cls in union}
    assert kinds == set(TARGETS) | set(UNAVAILABLE) and not set(TARGETS) & set(UNAVAILABLE)
