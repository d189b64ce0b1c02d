"""Generation backends behind one interface; ``build_engine(cfg)`` picks one by ``rollout.engine.type``.

Backends are imported lazily so a transformers-only install never imports vLLM or SGLang, and a
missing package fails with a message that says what to install.
"""

from __future__ import annotations

from rollout_server.engines.base import Chunk, Engine, EngineError, Sample, SamplingSpec
from tether.config import TetherConfig

__all__ = ["Chunk", "Engine", "EngineError", "Sample", "SamplingSpec", "build_engine"]


def build_engine(cfg: TetherConfig, *, named_adapters: bool = False) -> Engine:
    """The engine ``cfg.rollout.engine`` names, constructed but not started (``await engine.start()``).
    ``named_adapters``: requests may name LoRA adapters (a fleet's shared base; the transformers engine
    always can, vLLM is started for it)."""
    kind = cfg.rollout.engine.type
    if kind == "transformers":
        from rollout_server.engines.transformers_engine import TransformersEngine

        return TransformersEngine(cfg)
    if kind == "vllm":
        from rollout_server.engines.vllm_engine import VllmEngine

        return VllmEngine(cfg, named_adapters=named_adapters)
    if kind == "sglang":
        from rollout_server.engines.sglang_engine import SglangEngine

        return SglangEngine(cfg)
    raise EngineError(f"rollout.engine.type: unknown engine {kind!r}")  # unreachable: the config is a tagged union
