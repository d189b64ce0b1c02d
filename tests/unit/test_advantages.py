"""The advantage estimators on cases small enough to work out by hand; the comparisons with verl's own
``core_algos`` on random inputs are in ``tests/reference/``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from learner.advantages import ESTIMATORS, AdvantageBatch, advantage_batch, assign_advantages, get_estimator
from learner.batch import build_samples
from learner.synthetic import make_groups
from tether.config import AlgorithmConfig
from tether.config.adv_estimator import ADV_ESTIMATORS, declare_adv_estimator


def _one(mask: list[float], reward: float) -> AdvantageBatch:
    m = torch.tensor([mask], dtype=torch.float64)
    r = torch.zeros_like(m)
    r[0, max(i for i, x in enumerate(mask) if x)] = reward
    return AdvantageBatch(token_rewards=r, mask=m, group_ids=torch.zeros(1, dtype=torch.long))


@pytest.mark.parametrize(("gamma", "want"), [(1.0, [1.0, 0.0, 0.0, 1.0]), (0.5, [0.5, 0.0, 0.0, 1.0])])
def test_reinforce_plus_plus_carries_the_outcome_reward_across_an_environment_span(gamma, want) -> None:
    """Two model turns around an environment observation (mask [1, 0, 0, 1]), reward 1 at the end: the first
    turn's token sees the reward (discounted once per *trained* token, as verl 0.9 does); the observation
    tokens get return 0. The old rule reset the running return at every untrained token (return 0 there)."""
    b = _one([1.0, 0.0, 0.0, 1.0], 1.0)
    _, returns = get_estimator("reinforce_plus_plus").fn(b, AlgorithmConfig(gamma=gamma))
    assert_close(returns[0], torch.tensor(want, dtype=torch.float64))


def test_every_declared_estimator_has_a_function_with_the_same_needs() -> None:
    """The config's declarations (checked before torch is imported) and the learner's functions agree, under
    verl's names."""
    assert set(ADV_ESTIMATORS) == set(ESTIMATORS)
    assert {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"} <= set(ESTIMATORS)
    assert all(e.spec == ADV_ESTIMATORS[n] for n, e in ESTIMATORS.items())
    assert [n for n, e in ESTIMATORS.items() if e.needs_critic] == ["gae"]
    assert not [n for n, e in ESTIMATORS.items() if e.needs_reference]
    with pytest.raises(ValueError, match=r"no estimator function for 'nope'.*register_adv_est\('nope'\)"):
        get_estimator("nope")


def test_a_name_declared_again_with_other_needs_is_an_error() -> None:
    with pytest.raises(ValueError, match="'gae' is declared twice with different needs"):
        declare_adv_estimator("gae", needs_critic=False)
    assert declare_adv_estimator("gae", needs_critic=True) == ADV_ESTIMATORS["gae"]  # the same again: a no-op


def test_samples_get_the_reward_on_their_last_trained_token() -> None:
    groups = make_groups(3, 4, vocab=64, seed=5, completion_len=(5, 9))
    groups[0].trajectories[0].loss_mask[-1] = 0  # an environment token at the end
    groups[1].trajectories[0].loss_mask[:] = 0  # fully masked: the reward on its last token
    samples, _ = build_samples(groups, current_version=0)
    b = advantage_batch(samples, with_values=False)
    first, masked = samples[0], samples[4]
    assert b.token_rewards[0, first.num_completion - 2] == first.reward and b.token_rewards[0].sum() == first.reward
    assert b.token_rewards[4, masked.num_completion - 1] == masked.reward
    assign_advantages(samples, AlgorithmConfig())
    for s in samples:
        assert s.advantage.shape == (s.num_completion,)
        assert not s.advantage[s.loss_mask == 0].any()  # nothing outside the trained tokens, as verl
    rewards = groups[2].rewards().astype(np.float64)
    want = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    assert_close(torch.tensor([float(s.advantage[0]) for s in samples[8:]]), torch.tensor(want, dtype=torch.float32))
