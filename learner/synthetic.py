"""Synthetic trajectory groups with an RL-like length distribution, for tests and ``bench/learner.py``.

Completion lengths are long-tailed (log-uniform between ``min_len`` and ``max_len``): most answers are
short, a few run to the limit — the shape that makes padding expensive and packing worthwhile.
"""

from __future__ import annotations

import numpy as np

from tether.trajectory import GroupData, TrajectoryData


def log_uniform_lengths(rng: np.random.Generator, n: int, *, min_len: int, max_len: int) -> np.ndarray:
    return np.exp(rng.uniform(np.log(min_len), np.log(max_len), n)).astype(np.int64)


def make_groups(
    n_groups: int,
    group_size: int,
    *,
    vocab: int,
    seed: int = 0,
    prompt_len: tuple[int, int] = (4, 12),
    completion_len: tuple[int, int] = (4, 24),
    version: int = 0,
    log_uniform: bool = False,
) -> list[GroupData]:
    """``n_groups`` groups of ``group_size`` random trajectories with random rewards and log-probs."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n_groups):
        prompt = rng.integers(0, vocab, int(rng.integers(prompt_len[0], prompt_len[1] + 1)), dtype=np.int32)
        if log_uniform:
            lengths = log_uniform_lengths(rng, group_size, min_len=completion_len[0], max_len=completion_len[1])
        else:
            lengths = rng.integers(completion_len[0], completion_len[1] + 1, group_size)
        trajs = []
        for k, n in enumerate(lengths):
            n = int(n)
            mask = np.ones(n, dtype=np.uint8)
            if n > 3:
                mask[n // 2 : n // 2 + 1] = 0  # an environment token in the middle, never trained on
            trajs.append(
                TrajectoryData(
                    prompt_token_ids=prompt,
                    completion_token_ids=rng.integers(0, vocab, n, dtype=np.int32),
                    behavior_logprobs=(-rng.uniform(0.5, 6.0, n)).astype(np.float32),
                    policy_versions=np.full(n, version, dtype=np.int32),
                    loss_mask=mask,
                    reward=float(rng.uniform()),
                    id=f"s{seed}-g{g}-t{k}",
                    group_id=f"s{seed}-g{g}",
                )
            )
        groups.append(GroupData(group_id=f"s{seed}-g{g}", trajectories=trajs))
    return groups
