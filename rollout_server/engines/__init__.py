"""Generation backends behind one interface; ``build_engine(cfg)`` picks one by ``rollout.engine.type``.

Backends are imported lazily so a transformers-only install never imports vLLM or SGLang, and a
missing package fails with a message that says what to install.
"""

from __future__ import annotations

import importlib

from rollout_server.engines.base import Chunk, Completion, Engine, EngineError, SamplingSpec
from tether.config import TetherConfig

__all__ = ["ENGINES", "Chunk", "Completion", "Engine", "EngineError", "SamplingSpec", "build_engine"]


ENGINES = {
    "transformers": "rollout_server.engines.transformers_engine:TransformersEngine",
    "vllm": "rollout_server.engines.vllm_engine:VllmEngine",
    "sglang": "rollout_server.engines.sglang_engine:SglangEngine",
}
"""``rollout.engine.type`` -> its class (``module:Class``, imported on use). The one registration of an engine;
what it can do is declared by its config class (``tether/config/rollout.py``)."""


def build_engine(cfg: TetherConfig, *, named_adapters: bool = False) -> Engine:
    """The engine ``cfg.rollout.engine`` names, constructed but not started (``await engine.start()``).
    ``named_adapters``: requests may name LoRA adapters (a fleet's shared base, for an engine whose config
    declares ``shares_base``)."""
    kind = cfg.rollout.engine.type
    if kind not in ENGINES:  # unreachable through a loaded config: the engine config is a tagged union
        raise EngineError(f"rollout.engine.type: unknown engine {kind!r}; known: {sorted(ENGINES)}")
    module, _, name = ENGINES[kind].partition(":")
    engine_class = getattr(importlib.import_module(module), name)
    return engine_class(cfg, named_adapters=named_adapters)
