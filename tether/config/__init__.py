"""Typed configuration of every tether process: one section per component, validated at load time.

Import-light on purpose (pydantic and PyYAML only) so an entry point can reject a bad config in a
second, before torch, vLLM or transformers are imported.
"""

from tether.config.algorithm import AlgorithmConfig
from tether.config.buffer import BufferConfig
from tether.config.critic import CriticConfig
from tether.config.learner import LearnerConfig
from tether.config.loader import (
    ConfigError,
    dump_config,
    load_config,
    parse_overrides,
    save_resolved,
    validate_config,
)
from tether.config.model import ModelConfig
from tether.config.rollout import RolloutConfig
from tether.config.root import TetherConfig
from tether.config.run import RunConfig
from tether.config.weight_sync import WeightSyncConfig

__all__ = [
    "AlgorithmConfig",
    "BufferConfig",
    "ConfigError",
    "CriticConfig",
    "LearnerConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "TetherConfig",
    "WeightSyncConfig",
    "dump_config",
    "load_config",
    "parse_overrides",
    "save_resolved",
    "validate_config",
]
