"""Groups to samples: advantages per group, bad trajectories skipped and counted, never trained on."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.testing import assert_close

from learner.batch import build_samples
from learner.synthetic import make_groups


def test_bad_trajectories_are_skipped_and_counted() -> None:
    groups = make_groups(2, 4, vocab=50, seed=0, version=2)
    groups[0].trajectories[0].reward = math.inf
    groups[0].trajectories[1].behavior_logprobs = np.full(groups[0].trajectories[1].num_completion_tokens, np.nan)
    groups[1].trajectories[0].loss_mask = np.zeros_like(groups[1].trajectories[0].loss_mask)
    samples, skipped = build_samples(groups, current_version=3, norm_by_std=True)
    assert skipped == {"nonfinite_reward": 1, "nonfinite_logprob": 1, "fully_masked": 1}
    assert len(samples) == 5
    assert all(s.staleness == 1 and math.isfinite(s.advantage) for s in samples)
    # The fully masked trajectory still counts in its group's baseline: the other three do not sum to 0.
    adv_g1 = [s.advantage for s in samples if s.group == 1]
    rewards = groups[1].rewards()
    want = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    assert_close(torch.tensor(adv_g1), torch.tensor(want[1:], dtype=torch.float32))


def test_an_all_bad_batch_gives_no_samples() -> None:
    groups = make_groups(1, 2, vocab=50, seed=1)
    for t in groups[0].trajectories:
        t.reward = math.nan
    samples, skipped = build_samples(groups, current_version=0, norm_by_std=False)
    assert samples == [] and skipped == {"nonfinite_reward": 2}
