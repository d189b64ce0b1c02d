"""The advantage estimators, one registry entry each (``algorithm.adv_estimator``), as verl keys them.

An estimator is a pure function over one step's samples laid out padded, ``[S, T]`` (``T``: the longest
completion), the layout verl's ``core_algos`` uses, so each entry reads as its formula:

- ``token_rewards``: the trajectory's scalar reward on its last trained token, 0 elsewhere (outcome
  reward: tether's rewards are per trajectory);
- ``mask``: the loss mask (1.0 on trained tokens; environment tokens of a multi-turn episode are 0);
- ``group_ids``: ``[S]``, the prompt each sample answers (dense ``0..G-1``);
- ``values``: ``[S, T]`` the critic's values of the tokens' states (estimators that need a critic only);
- ``ref_logprobs``: ``[S, T]`` the frozen reference model's log-probs of the tokens (estimators that need
  a reference only).

It returns ``(advantages, returns)``, both ``[S, T]``; ``returns`` are the critic's regression targets
(the estimators without a critic return their advantages there, as verl does). Every rank holds the
whole step's samples, so batch statistics (whitening) are over the whole step on every rank alike.

A new estimator is one decorated function, ``@register_adv_est("<name>", needs_critic=..., needs_reference=...)``:
the decorator also declares the name and its needs to the config (:mod:`tether.config.adv_estimator`, where
the built-ins are declared too, so a config is checked before torch is imported), which then accepts the
name and refuses a config that lacks what it needs. The trainer reads the needs: it runs the critic or the
reference pass before the estimator when asked to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from learner.packing import Sample
from learner.registry import lookup
from tether.config.adv_estimator import AdvEstimatorSpec, declare_adv_estimator
from tether.config.algorithm import AlgorithmConfig


@dataclass
class AdvantageBatch:
    """One step's samples, padded to ``[S, T]`` (float64)."""

    token_rewards: Tensor
    mask: Tensor
    group_ids: Tensor
    values: Tensor | None = None
    ref_logprobs: Tensor | None = None


EstimatorFn = Callable[[AdvantageBatch, AlgorithmConfig], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Estimator:
    fn: EstimatorFn
    spec: AdvEstimatorSpec

    @property
    def needs_critic(self) -> bool:
        """The learner runs a critic (values before the step, a value update in it)."""
        return self.spec.needs_critic

    @property
    def needs_reference(self) -> bool:
        """The learner runs the reference model over the step's samples before the estimator."""
        return self.spec.needs_reference


ESTIMATORS: dict[str, Estimator] = {}
"""``algorithm.adv_estimator`` -> its function and needs; the config keys the needs alike
(:data:`tether.config.adv_estimator.ADV_ESTIMATORS`)."""


def register_adv_est(
    name: str, *, needs_critic: bool = False, needs_reference: bool = False
) -> Callable[[EstimatorFn], EstimatorFn]:
    """Decorator: ``fn`` is the estimator ``adv_estimator: name`` selects; declares ``name`` and its needs
    to the config (the same needs as a built-in declaration, or a new name)."""

    def add(fn: EstimatorFn) -> EstimatorFn:
        if name in ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is registered twice")
        spec = declare_adv_estimator(name, needs_critic=needs_critic, needs_reference=needs_reference)
        ESTIMATORS[name] = Estimator(fn, spec)
        return fn

    return add


def get_estimator(name: str) -> Estimator:
    return lookup(ESTIMATORS, name, key="algorithm.adv_estimator", what="estimator function",
                  decorator="register_adv_est")  # fmt: skip


# ----- helpers (verl's masked statistics)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum() / (mask.sum() + 1e-8)


def masked_whiten(x: Tensor, mask: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries, with the unbiased variance (verl's)."""
    n = mask.sum()
    if n < 2:
        return x - masked_mean(x, mask)  # one trained token has no spread to divide by
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def group_advantages(rewards: Tensor, group_ids: Tensor, *, norm_by_std: bool, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: reward minus its group's mean, optionally over the group's (unbiased) std + ``eps``.

    rewards: [S] float; group_ids: [S] long in ``0..G-1``. Returns [S] (float64). A group of one sample is
    given mean 0 and std 1, as verl's ``compute_grpo_outcome_advantage`` does: its advantage is its raw
    reward (over ``1 + eps``). Dr.GRPO is ``norm_by_std=False``; TRL's GRPOTrainer uses ``eps=1e-4``.
    """
    rewards = rewards.double()
    count, mean = _group_count_mean(rewards, group_ids)
    single = count[group_ids] == 1
    adv = rewards - torch.where(single, torch.zeros_like(rewards), mean[group_ids])
    if norm_by_std:
        centred = rewards - mean[group_ids]
        sq = torch.zeros_like(count).index_add_(0, group_ids, centred * centred)
        std = (sq / (count - 1).clamp(min=1)).sqrt()[group_ids]
        adv = adv / (torch.where(single, torch.ones_like(std), std) + eps)
    return adv


def _group_count_mean(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    n_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_ids, torch.ones_like(scores))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, group_ids, scores)
    return count, total / count.clamp(min=1)


# ----- the estimators


def _outcome(batch: AdvantageBatch, adv: Tensor) -> tuple[Tensor, Tensor]:
    """A per-sequence scalar on each of the sequence's trained tokens (0 elsewhere, as verl)."""
    out = adv.double()[:, None] * batch.mask
    return out, out


@register_adv_est("grpo")
def grpo(batch: AdvantageBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Reward minus the group mean, over the group std when ``norm_adv_by_std_in_grpo``."""
    scores = batch.token_rewards.sum(-1)
    return _outcome(batch, group_advantages(scores, batch.group_ids, norm_by_std=cfg.norm_adv_by_std_in_grpo))


@register_adv_est("dr_grpo")
def dr_grpo(batch: AdvantageBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """GRPO without the std (the config also sets ``loss_agg_mode: seq-mean-token-sum-norm``)."""
    scores = batch.token_rewards.sum(-1)
    return _outcome(batch, group_advantages(scores, batch.group_ids, norm_by_std=False))


@register_adv_est("rloo")
def rloo(batch: AdvantageBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Leave-one-out baseline: n/(n-1) (r - mean) = r - mean of the others; a group of one keeps r."""
    scores = batch.token_rewards.sum(-1)
    count, mean = _group_count_mean(scores, batch.group_ids)
    n = count[batch.group_ids]
    adv = torch.where(n > 1, (scores - mean[batch.group_ids]) * n / (n - 1).clamp(min=1), scores)
    out = adv[:, None] * batch.mask
    return out, out


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus(batch: AdvantageBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Discounted return-to-go (``gamma``) per token, whitened over the step's trained tokens."""
    returns = _discounted_returns(batch.token_rewards, batch.mask, cfg.gamma)
    return masked_whiten(returns, batch.mask) * batch.mask, returns


@register_adv_est("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(batch: AdvantageBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Reward minus the group mean (a group of one: no baseline), whitened over the step's trained tokens."""
    scores = batch.token_rewards.sum(-1)
    count, mean = _group_count_mean(scores, batch.group_ids)
    scores = scores - torch.where(count > 1, mean, torch.zeros_like(mean))[batch.group_ids]
    out = masked_whiten(scores[:, None] * batch.mask, batch.mask) * batch.mask
    return out, out


@register_adv_est("gae", needs_critic=True)
def gae(batch: AdvantageBatch, cfg: AlgorithmConfig) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (``gamma``, ``lam``) on the critic's values; untrained tokens are
    skipped (their value and TD error do not enter), returns = advantages + values, advantages whitened."""
    if batch.values is None:
        raise ValueError("gae needs the critic's values")
    rewards, values, mask = batch.token_rewards, batch.values, batch.mask
    next_value = torch.zeros_like(rewards[:, 0])
    last = torch.zeros_like(rewards[:, 0])
    adv = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + cfg.gamma * next_value - values[:, t]
        gae_t = delta + cfg.gamma * cfg.lam * last
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last = gae_t * mask[:, t] + (1 - mask[:, t]) * last
        adv[:, t] = last
    returns = adv + values
    return masked_whiten(adv, mask), returns


def _discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Return-to-go over the trained tokens (verl 0.9's rule): an untrained token (an environment span of
    a multi-turn episode) neither adds a reward nor a discount step and gets return 0; the running return
    is carried across it, so the first turn's tokens still see the episode's outcome reward."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        step = rewards[:, t] + gamma * running
        returns[:, t] = step * m
        running = step * m + running * (1 - m)
    return returns


# ----- samples in, samples out


def padded(samples: list[Sample], name: str) -> Tensor:
    """A completion-aligned field of every sample as ``[S, T]`` float64, zero-padded (and zero where a
    sample has no such field, as a fully masked sample has no values)."""
    width = max((s.num_completion for s in samples), default=0)
    out = torch.zeros(len(samples), width, dtype=torch.float64)
    for k, s in enumerate(samples):
        if (field := getattr(s, name)) is not None:
            out[k, : s.num_completion] = torch.from_numpy(np.asarray(field, dtype=np.float64))
    return out


def advantage_batch(samples: list[Sample], *, with_values: bool = False, with_ref: bool = False) -> AdvantageBatch:
    """The padded view of ``samples``; the reward sits on each sample's last trained token (on its last
    token when it has none: a fully masked sample still counts in its group's baseline, as in verl).
    ``with_values``/``with_ref``: also the critic's values, the reference's log-probs (set on the samples)."""
    mask = padded(samples, "loss_mask")
    rewards = torch.zeros_like(mask)
    for k, s in enumerate(samples):
        trained = np.flatnonzero(s.loss_mask)
        rewards[k, int(trained[-1]) if trained.size else s.num_completion - 1] = s.reward
    _, group_ids = torch.unique(torch.tensor([s.group for s in samples]), return_inverse=True)
    return AdvantageBatch(
        token_rewards=rewards,
        mask=mask,
        group_ids=group_ids,
        values=padded(samples, "values") if with_values else None,
        ref_logprobs=padded(samples, "ref_logprobs") if with_ref else None,
    )


def assign_advantages(samples: list[Sample], cfg: AlgorithmConfig) -> None:
    """Run ``cfg.adv_estimator`` over ``samples`` and store each sample's per-token advantages and returns.

    The one place a step's advantages are computed. ``samples`` are all of the step's usable samples,
    fully masked ones included (they are in their group's baseline, as in verl, but are not trained on);
    they carry the critic's values or the reference's log-probs when the estimator needs them."""
    if not samples:
        return
    est = get_estimator(cfg.adv_estimator)
    batch = advantage_batch(samples, with_values=est.needs_critic, with_ref=est.needs_reference)
    adv, ret = est.fn(batch, cfg)
    for k, s in enumerate(samples):
        n = s.num_completion
        s.advantage = adv[k, :n].float().numpy()
        s.returns = ret[k, :n].float().numpy()
