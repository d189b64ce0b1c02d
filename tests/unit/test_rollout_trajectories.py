"""The rollout server's one trajectory builder (the import layering is tests/unit/test_layering.py)."""

from __future__ import annotations

import numpy as np
import pytest

from buffer.codec import decode_payload, encode_payload
from rollout_server.trajectories import build_trajectory
from tether.trajectory import TEMPERATURE_KEY, GroupData, validate


@pytest.mark.parametrize("mask", [None, [1, 0, 1]])
def test_build_trajectory_fills_the_contract(mask: list[int] | None) -> None:
    t = build_trajectory(
        trajectory_id="g-0", group_id="g", prompt_ids=[5, 6], token_ids=[7, 8, 9], logprobs=[-0.5, -1.0, -0.25],
        versions=[3, 3, 4], loss_mask=mask, finish_reason=1, server_id="r0", logprob_source="processed",
        temperature=0.7, started_at=10.0, reward=0.5, reward_components={"a": 1.0}, metadata={"turns": "2"},
    )  # fmt: skip
    validate(t)
    assert [a.dtype.str for a in (t.prompt_token_ids, t.completion_token_ids, t.behavior_logprobs)] == [
        "<i4",
        "<i4",
        "<f4",
    ]
    assert t.policy_versions.tolist() == [3, 3, 4] and t.loss_mask.dtype == np.uint8
    assert t.loss_mask.tolist() == (mask or [1, 1, 1])
    assert t.metadata == {"turns": "2", TEMPERATURE_KEY: "0.7"}  # what the learner scores the tokens at
    assert t.finished_at >= t.started_at == 10.0 and t.reward == 0.5 and t.reward_components == {"a": 1.0}
    back = decode_payload(*encode_payload(GroupData("g", [t]))).trajectories[0]  # through the buffer's codec
    assert back.behavior_logprobs.tolist() == [-0.5, -1.0, -0.25]
