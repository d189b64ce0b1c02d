"""``algorithm``: advantages, the policy loss (its own knobs in :mod:`tether.config.policy_loss`), off-policy
correction, staleness."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, SerializeAsAny, field_validator, model_validator

from tether.config.adv_estimator import AdvEstimatorSpec, adv_estimator_spec
from tether.config.base import Section
from tether.config.policy_loss import PolicyLossConfig, VanillaLoss, as_policy_loss_config

LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class AlgorithmConfig(Section):
    max_staleness: int = Field(default=1, ge=0)
    """Policy versions rollout may run ahead of the learner (AReaL's eta). 0: synchronous on-policy."""

    stale_wait_s: float = Field(default=300.0, ge=0)
    """How long a learner step waits for groups that would pass ``max_staleness`` if it trained without
    them: groups of prompts issued ``max_staleness`` versions ago that are still generating (the long
    completions, which arrive last). They are then trained this step, oldest first, and nothing is dropped
    for being long; after the wait the step goes on and such a group is dropped as stale (counted per length
    in ``tether status``). 0: never wait, train on what arrived first (faster, but the long completions are
    the ones dropped: docs/STALENESS.md)."""

    adv_estimator: str = "grpo"
    """A registered estimator (:mod:`tether.config.adv_estimator`), verl's names: ``grpo``: reward minus group
    mean (optionally over group std); ``dr_grpo``: no std normalisation, and the loss is aggregated as
    ``seq-mean-token-sum-norm``; ``rloo``: reward minus the mean of the group's other samples;
    ``reinforce_plus_plus``: discounted return whitened over the batch; ``reinforce_plus_plus_baseline``:
    reward minus group mean, whitened over the batch; ``gae``: PPO with a critic (the ``critic`` section),
    generalised advantage estimation. An unknown name, or one whose needs (a critic) the config does not
    meet, is refused at load time."""

    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount per token (``gae``, ``reinforce_plus_plus``)."""

    lam: float = Field(default=1.0, ge=0, le=1)
    """GAE's lambda: 1 is the Monte-Carlo return minus the value, 0 the one-step TD error."""

    policy_loss: SerializeAsAny[PolicyLossConfig] = Field(default_factory=VanillaLoss)
    """The policy loss, keyed by ``loss_mode`` as verl's ``policy_loss.loss_mode`` (``vanilla``: decoupled
    PPO-clip with the clip, importance-sampling, KL and entropy knobs below), with that loss's own knobs
    (:mod:`tether.config.policy_loss`)."""

    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group's reward standard deviation."""

    clip_ratio_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO clip: ratio lower bound 1 - clip_ratio_low."""

    clip_ratio_high: float = Field(default=0.28, ge=0)
    """PPO clip: ratio upper bound 1 + clip_ratio_high (> low: DAPO's clip-higher)."""

    clip_ratio_c: float = Field(default=3.0, gt=1)
    """Dual-clip bound for negative advantages (verl's ``clip_ratio_c``)."""

    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses are reduced to one number."""

    recompute_logprobs: bool = True
    """Recompute proximal log-probs with the learner's current weights before the update (decoupled
    PPO). False: the behaviour log-probs stand in for the proximal policy."""

    tis_imp_ratio_cap: float = Field(default=2.0, gt=0)
    """Cap on the importance weight proximal / behaviour (truncated importance sampling)."""

    tis_level: Literal["token", "sequence", "geometric"] = "token"
    """Importance weights per token; ``sequence``: one per sequence, the product of its token ratios
    (verl's ``rollout_is: sequence``); ``geometric``: one per sequence, their geometric mean."""

    tis_mode: Literal["truncate", "mask"] = "truncate"
    """``truncate``: weights above the cap are set to the cap; ``mask``: those tokens are dropped."""

    use_kl_loss: bool = False
    """Add a KL penalty to a frozen reference model."""

    kl_loss_coef: float = Field(default=0.001, ge=0)
    """Weight of the KL penalty."""
    kl_loss_type: Literal["k1", "k3"] = "k3"
    """KL estimator: k1 = log ratio, k3 = Schulman's unbiased low-variance estimator."""

    entropy_coeff: float = Field(default=0.0, ge=0)
    """Entropy bonus weight."""

    @field_validator("adv_estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return adv_estimator_spec(value).name

    @property
    def estimator(self) -> AdvEstimatorSpec:
        """What ``adv_estimator`` needs (a critic, a reference model)."""
        return adv_estimator_spec(self.adv_estimator)

    @property
    def uses_reference(self) -> bool:
        """The learner loads the frozen reference model: for the KL loss, or for an estimator that reads it."""
        return self.use_kl_loss or self.estimator.needs_reference

    @field_validator("policy_loss", mode="before")
    @classmethod
    def _loss_class(cls, value: Any) -> Any:
        return as_policy_loss_config(value)

    @model_validator(mode="after")
    def _dr_grpo(self) -> AlgorithmConfig:
        """Dr.GRPO is GRPO without the std and with ``seq-mean-token-sum-norm`` (verl's recipe sets both):
        ``dr_grpo`` sets them, and refuses an explicit setting that says otherwise."""
        if self.adv_estimator != "dr_grpo":
            return self
        given = self.model_fields_set
        if "norm_adv_by_std_in_grpo" in given and self.norm_adv_by_std_in_grpo:
            raise ValueError("adv_estimator: dr_grpo has no std normalisation — drop norm_adv_by_std_in_grpo: true, "
                             "or use adv_estimator: grpo")  # fmt: skip
        if "loss_agg_mode" in given and self.loss_agg_mode != "seq-mean-token-sum-norm":
            raise ValueError(f"adv_estimator: dr_grpo aggregates the loss as seq-mean-token-sum-norm, not "
                             f"{self.loss_agg_mode} — drop loss_agg_mode, or use adv_estimator: grpo with "
                             "norm_adv_by_std_in_grpo: false for its advantages with another aggregation")  # fmt: skip
        # Make the config say what runs (the resolved config.yaml shows both).
        object.__setattr__(self, "norm_adv_by_std_in_grpo", False)
        object.__setattr__(self, "loss_agg_mode", "seq-mean-token-sum-norm")
        return self
