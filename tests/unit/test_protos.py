"""The wire contracts: generated protobuf code is fresh, and trajectory groups survive a round trip through the
buffer's codec (:mod:`buffer.columnar`, the one a group travels in) unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from buffer.codec import CODEC_COLUMNAR, decode_group_payload, decode_payload, encode_payload
from buffer.columnar import encode_columnar
from tether import protogen
from tether.trajectory import GroupData, InvalidTrajectory, TrajectoryData
from tether.v1 import control_pb2_grpc, reward_pb2_grpc, rollout_pb2_grpc, trajectory_pb2


def test_generated_code_is_not_stale() -> None:
    assert protogen.stale_files() == [], "run: python -m tether.protogen"


def test_services_are_generated() -> None:
    assert hasattr(rollout_pb2_grpc, "RolloutStub") and hasattr(rollout_pb2_grpc, "add_RolloutServicer_to_server")
    assert hasattr(control_pb2_grpc, "ControlStub")
    assert hasattr(reward_pb2_grpc, "RewardServicer")


def random_group(rng: np.random.Generator, g: int, max_len: int) -> GroupData:
    trajectories = []
    for i in range(g):
        n = int(rng.integers(0, max_len))
        trajectories.append(
            TrajectoryData(
                prompt_token_ids=rng.integers(0, 150_000, int(rng.integers(1, 64))),
                completion_token_ids=rng.integers(0, 150_000, n),
                behavior_logprobs=-rng.exponential(1.0, n).astype(np.float32),
                policy_versions=rng.integers(0, 1000, n),
                loss_mask=rng.integers(0, 2, n),
                reward=float(rng.normal()),
                reward_components={"format": float(rng.random()), "answer": float(rng.random())},
                finish_reason=trajectory_pb2.FINISH_REASON_STOP if i % 2 else trajectory_pb2.FINISH_REASON_LENGTH,
                server_id="rollout-0",
                metadata={"turns": str(i), "ünïcode": "✓"},
                started_at=1_700_000_000.25,
                finished_at=1_700_000_001.5,
            )
        )
    return GroupData(
        group_id=f"g-{rng.integers(1 << 30)}",
        trajectories=trajectories,
        prompt_id="1-0",
        metadata={"dataset_index": "7"},
    )


def assert_same(a: GroupData, b: GroupData) -> None:
    assert (a.group_id, a.prompt_id, a.metadata) == (b.group_id, b.prompt_id, b.metadata)
    assert len(a.trajectories) == len(b.trajectories)
    for x, y in zip(a.trajectories, b.trajectories, strict=True):
        for name in ("prompt_token_ids", "completion_token_ids", "policy_versions", "loss_mask"):
            np.testing.assert_array_equal(getattr(x, name), getattr(y, name), err_msg=name)
        np.testing.assert_array_equal(np.asarray(x.behavior_logprobs, np.float32), y.behavior_logprobs)
        assert (x.id, x.group_id, x.reward, x.reward_components, x.finish_reason, x.server_id, x.metadata) == (
            y.id,
            y.group_id,
            y.reward,
            y.reward_components,
            y.finish_reason,
            y.server_id,
            y.metadata,
        )
        assert x.started_at == pytest.approx(y.started_at) and x.finished_at == pytest.approx(y.finished_at)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), g=st.integers(1, 16), max_len=st.integers(1, 2048))
def test_group_round_trip(seed: int, g: int, max_len: int) -> None:
    group = random_group(np.random.default_rng(seed), g, max_len)
    back = decode_payload(*encode_payload(group))
    assert_same(group, back)
    # decoding again from the re-encoded group is byte-identical: the encoding is canonical
    assert encode_columnar(back)[0] == encode_columnar(group)[0]


def test_oldest_version_and_token_count() -> None:
    group = random_group(np.random.default_rng(0), 4, 64)
    expected = min(int(t.policy_versions.min()) for t in group.trajectories if t.policy_versions.size)
    back, oldest = decode_group_payload(*encode_payload(group))
    assert oldest == back.oldest_version == group.oldest_version == expected
    tokens = sum(t.prompt_token_ids.size + t.completion_token_ids.size for t in group.trajectories)
    assert back.num_tokens == group.num_tokens == tokens


@pytest.mark.parametrize(
    "payload", [b"\x80\x04\x95 pickle", b"\xff" * 17, b"not a group at all", b"TGC\x01" + b"\0" * 12]
)
def test_garbage_is_rejected(payload: bytes) -> None:
    with pytest.raises(InvalidTrajectory):
        decode_payload(CODEC_COLUMNAR, payload)
