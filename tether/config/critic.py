"""``critic``: the value model of PPO with GAE (``algorithm.adv_estimator: gae``), with verl's knob names.

The critic is a second FSDP2 module on the learner ranks: by default the actor's base model with a
scalar value head. Its values are computed by the learner before each step; it never leaves the
learner (no weight sync) and is part of every checkpoint. Its token budgets may be 2-4x the actor's:
its last layer is one number per position, not a vocabulary.
"""

from __future__ import annotations

from pydantic import Field

from tether.config.algorithm import LossAggMode
from tether.config.base import Section


class CriticOptimConfig(Section):
    lr: float = Field(default=1e-5, gt=0)
    """AdamW learning rate of the critic (verl's ``critic.optim.lr``); constant."""

    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""


class CriticConfig(Section):
    enable: bool | None = None
    """Whether the learner runs a critic (verl's ``critic.enable``); empty: when ``algorithm.adv_estimator``
    needs one (``gae``). ``false`` with such an estimator, or ``true`` with one that reads no values, is
    refused when the config is loaded."""

    model_path: str = ""
    """The critic's base model (a Hugging Face folder); empty: the actor's ``model.path``."""

    optim: CriticOptimConfig = Field(default_factory=CriticOptimConfig)

    ppo_epochs: int = Field(default=1, gt=0)
    """Passes of the critic over each step's data."""

    ppo_micro_batch_size_per_gpu: int = Field(default=8, gt=0)
    """Sequences per critic forward/backward on one GPU (without dynamic batching)."""

    ppo_max_token_len_per_gpu: int = Field(default=16384, gt=0)
    """Token budget of one critic update micro-batch with ``learner.use_dynamic_bsz``."""

    forward_micro_batch_size_per_gpu: int = Field(default=16, gt=0)
    """Sequences per forward-only value pass (without dynamic batching)."""

    forward_max_token_len_per_gpu: int = Field(default=32768, gt=0)
    """Token budget of one forward-only value pass with ``learner.use_dynamic_bsz``."""

    loss_agg_mode: LossAggMode | None = None
    """How the value loss's per-token terms are reduced; empty: the actor's ``algorithm.loss_agg_mode`` (verl's
    ``critic.loss_agg_mode``, which defaults to the actor's too)."""

    cliprange_value: float = Field(default=0.5, gt=0)
    """Values may move at most this far from the step's old values before the loss is clipped."""

    grad_clip: float = Field(default=1.0, gt=0)
    """Gradient norm clip of the critic."""

    enable_gradient_checkpointing: bool = False
    """Recompute the critic's activations in backward."""

    critic_warmup: int = Field(default=0, ge=0)
    """Steps in which only the critic trains (the actor waits); verl's ``trainer.critic_warmup``."""
