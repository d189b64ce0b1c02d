"""The whole config: one section per component, as in ``configs/*.yaml``, and the rules that span sections."""

from __future__ import annotations

from pydantic import Field, model_validator

from tether.config.adv_estimator import check_estimator_needs
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

    @model_validator(mode="after")
    def _estimator_needs(self) -> TetherConfig:
        # The estimator is the algorithm section's, what it needs lives in others (critic, learner).
        check_estimator_needs(self)
        return self

    @model_validator(mode="after")
    def _one_prompt_limit(self) -> TetherConfig:
        # One limit under two names (verl's learner-side ``max_prompt_length``, the servers' ``max_prompt_len``):
        # a learner limit above the servers' admits prompts every server refuses, so that can only fail.
        wanted = self.learner.max_prompt_length
        if wanted is None:
            return self
        if "max_prompt_len" not in self.rollout.model_fields_set:
            self.rollout.max_prompt_len = wanted  # the servers take the limit the learner was given
        elif wanted > self.rollout.max_prompt_len:
            raise ValueError(
                f"learner.max_prompt_length ({wanted}) is above rollout.max_prompt_len "
                f"({self.rollout.max_prompt_len}): rollout servers would refuse every prompt in between — raise "
                "rollout.max_prompt_len to it, or leave learner.max_prompt_length empty (it follows "
                "rollout.max_prompt_len)"
            )
        return self

    @property
    def prompt_limit(self) -> tuple[int, str]:
        """The longest prompt in tokens the learner admits, and the setting that says so:
        ``learner.max_prompt_length`` when given, else ``rollout.max_prompt_len`` (the rollout servers'
        limit; both are further capped by the model's context, which only the model folder tells)."""
        if self.learner.max_prompt_length is not None:
            return self.learner.max_prompt_length, "learner.max_prompt_length"
        return self.rollout.max_prompt_len, "rollout.max_prompt_len"
