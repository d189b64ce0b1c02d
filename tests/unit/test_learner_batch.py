"""Groups to samples: bad trajectories skipped and counted, never trained on; fully masked ones kept for their
group's baseline and then left out of training; the advantages come from the one estimator pass."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.testing import assert_close

from learner.advantages import assign_advantages
from learner.batch import build_samples
from learner.synthetic import make_groups
from tether.config import AlgorithmConfig


def _with_advantages(groups, **algorithm):
    samples, skipped = build_samples(groups, current_version=0)
    assign_advantages(samples, AlgorithmConfig(**algorithm))
    return samples, skipped


def test_bad_trajectories_are_skipped_and_counted() -> None:
    groups = make_groups(2, 4, vocab=50, seed=0, version=2)
    groups[0].trajectories[0].reward = math.inf
    groups[0].trajectories[1].behavior_logprobs = np.full(groups[0].trajectories[1].num_completion_tokens, np.nan)
    groups[1].trajectories[0].loss_mask = np.zeros_like(groups[1].trajectories[0].loss_mask)
    samples, skipped = build_samples(groups, current_version=3)
    assert skipped == {"nonfinite_reward": 1, "nonfinite_logprob": 1, "fully_masked": 1}
    assert len(samples) == 6 and sum(s.num_trained > 0 for s in samples) == 5
    assert all(s.staleness == 1 for s in samples)


def test_a_fully_masked_sample_counts_in_its_groups_baseline_and_has_no_advantage() -> None:
    """verl scores every response of a group, whatever its loss mask: a fully masked one (all environment
    tokens) still moves its group's mean and std. Before, the learner left it out of the trainer's baseline."""
    groups = make_groups(2, 4, vocab=50, seed=0)
    groups[1].trajectories[0].loss_mask = np.zeros_like(groups[1].trajectories[0].loss_mask)
    samples, _ = _with_advantages(groups)
    rewards = groups[1].rewards().astype(np.float64)
    want = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    got = [float(s.advantage[0]) for s in samples if s.group == 1]
    assert_close(torch.tensor(got[1:]), torch.tensor(want[1:], dtype=torch.float32))
    masked = next(s for s in samples if s.group == 1)
    assert not masked.advantage.any()


def test_an_all_bad_batch_gives_no_samples() -> None:
    groups = make_groups(1, 2, vocab=50, seed=1)
    for t in groups[0].trajectories:
        t.reward = math.nan
    samples, skipped = build_samples(groups, current_version=0)
    assert samples == [] and skipped == {"nonfinite_reward": 2}


def test_aborted_samples_are_not_trained_and_leave_the_baseline() -> None:
    from tether.v1.trajectory_pb2 import FINISH_REASON_ABORTED

    groups = make_groups(1, 4, vocab=50, seed=2)
    groups[0].trajectories[1].finish_reason = FINISH_REASON_ABORTED
    samples, skipped = _with_advantages(groups, norm_adv_by_std_in_grpo=False)
    assert skipped == {"aborted": 1} and len(samples) == 3
    rewards = groups[0].rewards()[[0, 2, 3]]
    assert_close(torch.tensor([s.advantage[0] for s in samples]), torch.tensor(rewards - rewards.mean()).float())


def test_groups_left_with_one_sample_are_counted_and_keep_their_reward() -> None:
    """verl's GRPO gives a group of one mean 0 and std 1: its advantage is the raw reward (over 1 + eps)."""
    groups = make_groups(3, 2, vocab=50, seed=3)
    groups[0].trajectories[0].reward = math.nan  # group 0 keeps one sample
    groups[2] = type(groups[2])("solo", groups[2].trajectories[:1])  # a group of one from the start
    samples, skipped = _with_advantages(groups)
    assert skipped == {"nonfinite_reward": 1, "single_sample_groups": 2}
    solo = [s for s in samples if s.group != 1]
    want = torch.tensor([s.reward / (1 + 1e-6) for s in solo], dtype=torch.float32)
    assert_close(torch.tensor([float(s.advantage[0]) for s in solo]), want)


def test_groups_with_all_equal_rewards_are_counted_against_a_loop() -> None:
    # A collapsed policy gives every sample of a prompt the same reward: no advantage, no gradient.
    rng = np.random.default_rng(5)
    groups = make_groups(12, 4, vocab=50, seed=5)
    for g in groups:
        if rng.random() < 0.5:
            for t in g.trajectories:
                t.reward = 0.25
    groups[0].trajectories[0].reward = math.nan  # the survivors still agree (or not) among themselves
    groups[1] = type(groups[1])("solo", groups[1].trajectories[:1])  # one sample: counted apart
    samples, skipped = _with_advantages(groups)
    want = 0
    for g in groups:
        rewards = [t.reward for t in g.trajectories if math.isfinite(t.reward)]
        want += len(rewards) > 1 and max(rewards) == min(rewards)
    assert 0 < want < len(groups) - 1
    assert skipped["zero_std_groups"] == want and skipped["single_sample_groups"] == 1
    flat = [g for g in {s.group for s in samples} if len({s.reward for s in samples if s.group == g}) == 1 and g != 1]
    assert all(np.abs(s.advantage).max() < 1e-9 for s in samples if s.group in flat)


def test_each_sample_carries_the_temperature_it_was_sampled_at() -> None:
    from tether.trajectory import TEMPERATURE_KEY

    groups = make_groups(1, 6, vocab=50, seed=4)
    t = groups[0].trajectories
    for x in t:
        x.logprob_source = "processed"
    t[0].metadata = {TEMPERATURE_KEY: "0.7"}
    t[1].metadata = {}  # not recorded: the configured rollout.temperature
    t[2].metadata = {TEMPERATURE_KEY: "0.0"}  # greedy: log-probs of T = 1
    t[3].metadata, t[3].logprob_source = {TEMPERATURE_KEY: "0.7"}, "raw"  # raw log-probs are of T = 1
    t[4].metadata = {TEMPERATURE_KEY: "hot"}
    t[5].metadata = {TEMPERATURE_KEY: "-1"}
    samples, skipped = build_samples(groups, current_version=0, default_temperature=0.5)
    assert skipped == {"bad_temperature": 2}
    assert [s.temperature for s in samples] == [0.7, 0.5, 1.0, 1.0]


def test_rank_broadcast_payload_round_trips_every_field() -> None:
    """What rank 0 packs is the protobuf message the generated code reads, and what the other ranks unpack
    equals what was sent, field for field (rich groups: reward components, metadata, timestamps)."""
    from learner.batch import pack_groups, unpack_groups
    from tests.unit.test_buffer_codec import make_group
    from tether.trajectory import decode_group

    sent = [make_group(rich=True, seed=s, tokens=16 * (s + 1)) for s in range(3)]
    header, raw = pack_groups(sent, stop=7)
    got, stop = unpack_groups(header.clone(), bytes(raw))
    assert stop == 7 and len(got) == len(sent)
    offset = 0
    for a, b, n in zip(got, sent, header[2:].tolist(), strict=True):
        assert decode_group(bytes(raw[offset : offset + n])).group_id == b.group_id  # the generated parser agrees
        offset += n
        assert (a.group_id, a.prompt_id, a.metadata) == (b.group_id, b.prompt_id, b.metadata)
        for ta, tb in zip(a.trajectories, b.trajectories, strict=True):
            for name, value in vars(tb).items():
                if isinstance(value, np.ndarray):
                    assert getattr(ta, name).dtype == value.dtype and getattr(ta, name).tobytes() == value.tobytes()
                elif name in ("started_at", "finished_at"):  # protobuf Timestamps: nanoseconds, not a double
                    assert abs(getattr(ta, name) - value) < 1e-6, name
                else:
                    assert getattr(ta, name) == value, name
    assert unpack_groups(*pack_groups([], stop=0)) == ([], 0)
