"""The whole config: one section per component, as in ``configs/*.yaml``."""

from __future__ import annotations

from pydantic import Field

from tether.config.algorithm import AlgorithmConfig
from tether.config.base import Section
from tether.config.buffer import BufferConfig
from tether.config.critic import CriticConfig
from tether.config.learner import LearnerConfig
from tether.config.model import ModelConfig
from tether.config.rollout import RolloutConfig
from tether.config.run import RunConfig
from tether.config.weight_sync import WeightSyncConfig


class TetherConfig(Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    weight_sync: WeightSyncConfig = Field(default_factory=WeightSyncConfig)
