"""The buffer's rules (:mod:`buffer.policy`): admission arithmetic, staleness, which counter a stale group
goes to — and that the reader and the learner's sample builder measure staleness the same way."""

from __future__ import annotations

import numpy as np
import pytest

from buffer.policy import DROPPED_STALE, DROPPED_STALE_ENV, admission_allowance, stale_counter, staleness_of
from learner.batch import build_samples
from tether.trajectory import PROMPT_GROUP_PREFIX, GroupData, TrajectoryData
from tether.v1 import trajectory_pb2 as pb


# -- admission -------------------------------------------------------------------------------------------
def test_admission_synchronous_issues_one_version_at_a_time() -> None:
    assert admission_allowance(0, version=0, prompts_per_version=8, max_staleness=0) == 8
    assert admission_allowance(8, version=0, prompts_per_version=8, max_staleness=0) == 0
    assert admission_allowance(8, version=1, prompts_per_version=8, max_staleness=0) == 8


def test_admission_runs_ahead_by_max_staleness_versions() -> None:
    assert admission_allowance(0, version=0, prompts_per_version=4, max_staleness=2) == 12
    assert admission_allowance(10, version=3, prompts_per_version=4, max_staleness=2) == 14
    assert admission_allowance(100, version=1, prompts_per_version=4, max_staleness=1) == 0  # never negative


@pytest.mark.parametrize("kwargs", [{"prompts_per_version": 0}, {"max_staleness": -1}, {"version": -1}])
def test_admission_rejects_nonsense(kwargs: dict) -> None:
    args = {"version": 0, "prompts_per_version": 4, "max_staleness": 1} | kwargs
    with pytest.raises(ValueError):
        admission_allowance(0, **args)


def test_staleness_of() -> None:
    assert staleness_of(3, 5) == 2
    assert staleness_of(5, 5) == 0
    assert staleness_of(7, 5) == 0  # tagged with a version the learner has not reached: fresh
    assert staleness_of(-1, 5) == 0  # a group without completion tokens


def test_only_prompt_born_groups_give_admission_back() -> None:
    assert stale_counter(f"{PROMPT_GROUP_PREFIX}1700000000000-0") == DROPPED_STALE
    assert stale_counter("episode-group-7") == DROPPED_STALE_ENV


def random_group(rng: np.random.Generator, gid: int) -> GroupData:
    trajs = []
    for i in range(int(rng.integers(1, 6))):
        n = int(rng.integers(1, 40))
        trajs.append(
            TrajectoryData(
                prompt_token_ids=rng.integers(0, 100, 3, dtype=np.int32),
                completion_token_ids=rng.integers(0, 100, n, dtype=np.int32),
                behavior_logprobs=-rng.random(n, dtype=np.float32),
                policy_versions=rng.integers(0, 12, n, dtype=np.int32),  # some beyond the learner's version
                loss_mask=np.ones(n, dtype=np.uint8),
                reward=float(rng.random()),
                finish_reason=pb.FINISH_REASON_STOP,
                id=f"t{gid}-{i}",
            )
        )
    return GroupData(group_id=f"g{gid}", trajectories=trajs)


@pytest.mark.parametrize("seed", range(5))
def test_learner_samples_and_reader_share_one_staleness(seed: int) -> None:
    """Each sample's staleness is the formula on its own tokens; its group's is the largest of them, which
    is what the reader computes from the group's oldest token (compared against real Redis in
    tests/integration/test_buffer_seams.py)."""
    rng = np.random.default_rng(seed)
    groups = [random_group(rng, k) for k in range(6)]
    current = int(rng.integers(0, 10))
    samples, _ = build_samples(groups, current_version=current)
    assert len(samples) == sum(len(g.trajectories) for g in groups)
    by_group: dict[int, list[int]] = {}
    for s in samples:
        by_group.setdefault(s.group, []).append(s.staleness)
    for gi, g in enumerate(groups):
        expected = [max(0, current - int(t.policy_versions.min())) for t in g.trajectories]  # the closed form
        assert by_group[gi] == expected
        assert max(by_group[gi]) == staleness_of(g.oldest_version, current)
