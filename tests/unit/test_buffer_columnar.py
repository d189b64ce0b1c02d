"""The columnar group payload (:mod:`buffer.columnar`): exact round trips on random groups, the same refusals
as :func:`tether.trajectory.validate`, and clear errors for a payload of another version or a bad header."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from buffer.codec import CODEC_COLUMNAR, decode_group_payload, encode_group_payload
from buffer.columnar import decode_columnar, encode_columnar
from tests.unit.test_buffer_codec import make_group
from tether.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    GroupData,
    InvalidTrajectory,
    TrajectoryData,
    validate,
)

_ARRAYS = ("prompt_token_ids", "completion_token_ids", "behavior_logprobs", "policy_versions", "loss_mask")
_WIRE_DTYPES = dict(zip(_ARRAYS, (TOKEN_DTYPE, TOKEN_DTYPE, LOGPROB_DTYPE, VERSION_DTYPE, MASK_DTYPE), strict=True))
_SCALARS = (
    "reward",
    "reward_components",
    "finish_reason",
    "id",
    "group_id",
    "server_id",
    "logprob_source",
    "metadata",
    "started_at",
    "finished_at",
)


def random_group(seed: int, *, g: int) -> GroupData:
    """Ragged lengths (empty prompts and completions included), random values in every field."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(g):
        n, p = int(rng.integers(0, 300)), int(rng.integers(0, 40))
        trajs.append(
            TrajectoryData(
                prompt_token_ids=rng.integers(0, 2**31 - 1, p, dtype=np.int32),
                completion_token_ids=rng.integers(0, 2**31 - 1, n, dtype=np.int32),
                behavior_logprobs=rng.standard_normal(n).astype(np.float32),
                policy_versions=rng.integers(0, 50, n, dtype=np.int32),
                loss_mask=rng.integers(0, 2, n, dtype=np.uint8),
                reward=float(rng.standard_normal()),
                reward_components={f"c{j}": float(rng.standard_normal()) for j in range(int(rng.integers(0, 3)))},
                finish_reason=int(rng.integers(0, 3)),
                id=f"t-{seed}-{i}-é",
                group_id=f"g-{seed}",
                server_id=f"rollout-{int(rng.integers(0, 4))}",
                logprob_source="processed",
                metadata={"turns": str(int(rng.integers(0, 5))), "note": 'ünïcode "quoted"'},
                started_at=float(rng.uniform(1.6e9, 1.8e9)),
                finished_at=float(rng.uniform(1.6e9, 1.8e9)),
            )
        )
    return GroupData(group_id=f"g-{seed}", trajectories=trajs, prompt_id=f"{seed}-0", metadata={"dataset_index": "7"})


@pytest.mark.parametrize("seed", range(6))
def test_round_trip_is_exact_on_random_groups(seed: int) -> None:
    group = random_group(seed, g=1 + seed % 8)
    payload, oldest, tokens = encode_columnar(group)
    back, back_oldest = decode_columnar(bytes(payload))
    assert (back.group_id, back.prompt_id, back.metadata) == (group.group_id, group.prompt_id, group.metadata)
    assert len(back.trajectories) == len(group.trajectories)
    for got, want in zip(back.trajectories, group.trajectories, strict=True):
        for name in _ARRAYS:
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), strict=True)
        for name in _SCALARS:
            assert getattr(got, name) == getattr(want, name), name
    assert oldest == back_oldest == group.oldest_version
    assert tokens == sum(t.num_completion_tokens for t in group.trajectories)


def test_decoded_arrays_are_read_only_views_into_the_payload() -> None:
    payload = bytes(encode_columnar(make_group(tokens=1024))[0])
    for t in decode_columnar(payload)[0].trajectories:
        for name in _ARRAYS:
            arr = getattr(t, name)
            assert not arr.flags.writeable
            assert np.shares_memory(arr, np.frombuffer(payload, np.uint8))


def test_arrays_of_other_dtypes_are_converted_to_the_wire_dtypes() -> None:
    group = make_group(g=2)
    group.trajectories[0].completion_token_ids = group.trajectories[0].completion_token_ids.astype(np.int64)
    group.trajectories[1].behavior_logprobs = group.trajectories[1].behavior_logprobs.astype(np.float64)[::-1].copy()
    group.trajectories[1].policy_versions = group.trajectories[1].policy_versions.astype(np.int64)
    back = decode_columnar(bytes(encode_columnar(group)[0]))[0]
    for got, want in zip(back.trajectories, group.trajectories, strict=True):
        for name in _ARRAYS:
            expected = np.asarray(getattr(want, name)).astype(_WIRE_DTYPES[name])
            np.testing.assert_array_equal(getattr(got, name), expected, strict=True)  # values and dtype


def test_arrays_that_do_not_fit_the_wire_are_refused_not_cut() -> None:
    group = make_group(g=2)
    group.trajectories[0].completion_token_ids = group.trajectories[0].completion_token_ids.astype(np.float64)
    with pytest.raises(InvalidTrajectory, match="completion_token_ids does not fit"):
        encode_columnar(group)
    group = make_group(g=2)
    group.trajectories[1].behavior_logprobs = np.zeros((16, 1), np.float32)
    with pytest.raises(InvalidTrajectory, match=r"behavior_logprobs does not fit .*one dimension"):
        encode_columnar(group)
    group = make_group(g=2)
    group.trajectories[1].loss_mask = [1] * 16  # a plain list is converted
    assert decode_columnar(encode_columnar(group)[0])[0].trajectories[1].loss_mask.tolist() == [1] * 16


def _break(kind: str, t: TrajectoryData) -> None:
    if kind == "negative token":
        t.completion_token_ids = t.completion_token_ids.copy()
        t.completion_token_ids[3] = -1
    elif kind == "negative prompt token":
        t.prompt_token_ids = t.prompt_token_ids.copy()
        t.prompt_token_ids[0] = -5
    elif kind == "mask of 2":
        t.loss_mask = t.loss_mask.copy()
        t.loss_mask[0] = 2
    elif kind == "negative version":
        t.policy_versions = t.policy_versions.copy()
        t.policy_versions[-1] = -1
    elif kind == "short log-probs":
        t.behavior_logprobs = t.behavior_logprobs[:-1]
    elif kind == "no id":
        t.id = ""


@pytest.mark.parametrize(
    "kind", ["negative token", "negative prompt token", "mask of 2", "negative version", "short log-probs", "no id"]
)
def test_encode_refuses_what_validate_refuses_with_its_message(kind: str) -> None:
    group = make_group(g=3)
    _break(kind, group.trajectories[1])
    with pytest.raises(InvalidTrajectory) as expected:
        validate(group.trajectories[1])
    with pytest.raises(InvalidTrajectory) as got:
        encode_group_payload(group)
    assert str(got.value) == str(expected.value)


def test_encode_refuses_a_trajectory_of_another_group_and_bad_types() -> None:
    group = make_group(g=2)
    group.trajectories[1].group_id = "another"
    with pytest.raises(InvalidTrajectory, match="its group is"):
        encode_columnar(group)
    group = make_group(g=2)
    group.trajectories[0].metadata = {"turns": 3}  # not str -> str
    with pytest.raises(InvalidTrajectory, match="trajectory metadata"):
        encode_columnar(group)
    group = make_group(g=2)
    group.trajectories[0].reward_components = {"x": object()}
    with pytest.raises(InvalidTrajectory, match="wrong type"):
        encode_columnar(group)


def test_numpy_scalars_in_reward_components_are_written_as_numbers() -> None:
    group = make_group(g=2, rich=True)
    group.trajectories[1].reward_components = {"format": np.float32(0.5), "answer": np.int64(1)}
    back = decode_columnar(bytes(encode_columnar(group)[0]))[0]
    assert back.trajectories[1].reward_components == {"format": 0.5, "answer": 1.0}


def _with_header(payload: bytes, **changes: object) -> bytes:
    _, _, g, hlen, _ = struct.unpack_from("<3sBIII", payload)
    start = 16 + 36 * g
    head = json.loads(payload[start : start + hlen]) | changes
    raw = json.dumps(head).encode()
    raw += b" " * (-(start + len(raw)) % 8)
    return payload[:8] + struct.pack("<I", len(raw)) + payload[12:start] + raw + payload[start + hlen :]


def _with_numbers(payload: bytes, *, nc: list[int] | None = None, np_: list[int] | None = None,
                  fr: list[int] | None = None) -> bytes:  # fmt: skip
    (g,) = struct.unpack_from("<I", payload, 4)
    block = struct.Struct(f"<{3 * g}d{3 * g}i")
    values = list(block.unpack_from(payload, 16))
    for k, new in enumerate((nc, np_, fr)):
        if new is not None:
            values[3 * g + k * g : 3 * g + (k + 1) * g] = new
    return payload[:16] + block.pack(*values) + payload[16 + block.size :]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"id": ["a", 2, "c", "d"]}, "'id' is not a list of 4 strs"),
        ({"id": ["a", "", "c", "d"]}, "trajectory has no id"),
        ({"s": ["a"]}, "'s' is not a list of 4"),
        ({"tm": [{}, {}, {}, {"a": 1}]}, "trajectory metadata"),
        ({"rc": [{}, {}, {}, {"a": "x"}]}, "reward components"),
        ({"m": []}, "group metadata"),
        ({"g": ""}, "no group_id"),
        ({"p": None}, "'p' is not a string"),
    ],
)
def test_a_bad_header_is_refused_naming_what_is_wrong(changes: dict, match: str) -> None:
    payload = bytes(encode_columnar(make_group())[0])
    with pytest.raises(InvalidTrajectory, match=match):
        decode_columnar(_with_header(payload, **changes))


@pytest.mark.parametrize(
    ("numbers", "match"),
    [
        ({"nc": [17, 16, 16, 15]}, None),  # same total: the cut moves, every check still holds
        ({"nc": [16, 16, 16, 17]}, "its header describes"),
        ({"np_": [5, 5, 10, 0]}, None),
        ({"np_": [5, 5, 5, -5]}, "negative"),
        ({"fr": [0, 0, 0, -1]}, "negative"),
    ],
)
def test_bad_lengths_are_refused(numbers: dict, match: str | None) -> None:
    payload = bytes(encode_columnar(make_group())[0])
    bad = _with_numbers(payload, **numbers)
    if match is None:
        back = decode_columnar(bad)[0].trajectories
        assert [len(t.completion_token_ids) for t in back] == numbers.get("nc", [16] * 4)
        assert [len(t.prompt_token_ids) for t in back] == numbers.get("np_", [5] * 4)
        return
    with pytest.raises(InvalidTrajectory, match=match):
        decode_columnar(bad)


def test_another_version_or_format_is_refused_with_the_reason() -> None:
    payload = bytes(encode_columnar(make_group())[0])
    with pytest.raises(InvalidTrajectory, match="version 2; this reader knows version 1"):
        decode_group_payload(CODEC_COLUMNAR, payload[:3] + b"\x02" + payload[4:])
    with pytest.raises(InvalidTrajectory, match="not a columnar trajectory group"):
        decode_group_payload(CODEC_COLUMNAR, b"\x0a\x07group-0\x12\x031-0")  # a protobuf group's first bytes
    start = 16 + 36 * 4
    with pytest.raises(InvalidTrajectory, match="header is not JSON"):
        decode_columnar(payload[:start] + b"x" + payload[start + 1 :])
    with pytest.raises(InvalidTrajectory, match="a group of 0 trajectories"):
        decode_columnar(payload[:4] + struct.pack("<I", 0) + payload[8:])
    with pytest.raises(InvalidTrajectory, match="bytes, its header describes"):
        decode_columnar(payload[:-1])


# The tail of make_group()'s payload (4 trajectories of 16 completion and 5 prompt tokens), from its end:
# loss_mask u1[64], prompt_token_ids i4[20], policy_versions i4[64], completion_token_ids i4[64].
_TAIL = {"loss_mask": (-64, 1), "prompt_token_ids": (-144, 4), "policy_versions": (-400, 4),
         "completion_token_ids": (-656, 4)}  # fmt: skip


@pytest.mark.parametrize(
    ("column", "index", "value", "message"),
    [
        ("loss_mask", 16 + 3, 2, "loss_mask values must be 0 or 1"),
        ("prompt_token_ids", 5 + 1, -1, "negative token id"),
        ("completion_token_ids", 16 + 15, -7, "negative token id"),
        ("policy_versions", 16, -1, "negative policy version"),
    ],
)
def test_decode_refuses_bad_values_as_validate_does(column: str, index: int, value: int, message: str) -> None:
    """A payload no encoder would write (a corrupt copy, a foreign writer): the reader refuses it with the message
    :func:`~tether.trajectory.validate` gives, naming the trajectory (the second: ``index`` falls in it)."""
    group = make_group()
    payload = bytearray(encode_columnar(group)[0])
    start, size = _TAIL[column]
    at = len(payload) + start + index * size
    payload[at : at + size] = value.to_bytes(size, "little", signed=size > 1)
    assert decode_columnar(bytes(encode_columnar(group)[0]))[0].group_id == group.group_id  # the untouched one
    with pytest.raises(InvalidTrajectory) as got:
        decode_group_payload(CODEC_COLUMNAR, bytes(payload))
    assert str(got.value) == f"trajectory {group.trajectories[1].id}: {message}"


@pytest.mark.parametrize(
    "rare",
    [
        {"metadata": {"": "", "temperature": "0.7", "ünï": "cödé ✓"}, "reward_components": {"int": 2, "neg": -0.5}},
        {"started_at": 1.5e-9, "finished_at": 1763900003.000000001},
        {"started_at": -86400.25, "finished_at": 1e12},  # before 1970, past year 9999
        {"reward": float("inf"), "reward_components": {"nan": float("nan")}},
    ],
)
def test_rare_maps_timestamps_and_numbers_round_trip(rare: dict) -> None:
    group = make_group(seed=5)
    group.metadata = {"dataset_index": "7", "": "empty key"}
    for t in group.trajectories:
        for name, value in rare.items():
            setattr(t, name, value)
    back = decode_columnar(bytes(encode_columnar(group)[0]))[0]
    assert back.metadata == group.metadata
    for got, want in zip(back.trajectories, group.trajectories, strict=True):
        for name in ("metadata", "started_at", "finished_at", "reward"):
            assert getattr(got, name) == getattr(want, name), name
        assert got.reward_components.keys() == want.reward_components.keys()
        for k, v in want.reward_components.items():  # nan != nan: compare as floats, nan matching nan
            assert np.isclose(got.reward_components[k], v, rtol=0, atol=0, equal_nan=True), k


def test_a_group_without_completion_tokens_has_oldest_version_minus_one() -> None:
    group = make_group(tokens=0, g=2)
    payload, oldest, tokens = encode_columnar(group)
    assert (oldest, tokens) == (-1, 0)
    back, back_oldest = decode_columnar(bytes(payload))
    assert back_oldest == back.oldest_version == -1
    assert [t.prompt_token_ids.tolist() for t in back.trajectories] == [
        t.prompt_token_ids.tolist() for t in group.trajectories
    ]
