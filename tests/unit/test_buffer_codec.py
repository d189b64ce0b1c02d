"""Pure logic of the buffer's serialization: payload encoding, compression, the legacy protobuf reader."""

from __future__ import annotations

import pickle
import zlib

import numpy as np
import pytest

import buffer.wire
from buffer.codec import (
    CODEC_COLUMNAR,
    CODEC_COLUMNAR_ZLIB,
    CODEC_PROTOBUF,
    CODEC_PROTOBUF_ZLIB,
    decode_group_columnar,
    decode_payload,
    encode_payload,
    read_header,
)
from buffer.columnar import encode_columnar
from buffer.wire import decode_group_fast
from tether.trajectory import (
    GroupData,
    InvalidTrajectory,
    TrajectoryData,
    decode_group,
    encode_group,
    validate,
    validate_group,
)
from tether.v1 import trajectory_pb2 as pb


def make_group(*, tokens: int = 16, g: int = 4, version: int = 2, rich: bool = False, seed: int = 0) -> GroupData:
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(g):
        versions = np.full(tokens, version, dtype=np.int32)
        versions[:2] = max(0, version - 1)
        trajs.append(
            TrajectoryData(
                prompt_token_ids=rng.integers(0, 1000, 5, dtype=np.int32),
                completion_token_ids=rng.integers(0, 1000, tokens, dtype=np.int32),
                behavior_logprobs=-rng.random(tokens, dtype=np.float32),
                policy_versions=versions,
                loss_mask=np.ones(tokens, dtype=np.uint8),
                reward=float(i),
                finish_reason=pb.FINISH_REASON_STOP,
                server_id="rollout-0",
                reward_components={"format": 0.5, "answer": 1.0} if rich else {},
                metadata={"turns": "3"} if rich else {},
                started_at=1700000000.25 if rich else 0.0,
                finished_at=1700000001.5 if rich else 0.0,
            )
        )
    return GroupData(group_id=f"group-{seed}", trajectories=trajs, prompt_id="1-0", metadata={"k": "v"} if rich else {})


# -- the legacy protobuf reader -----------------------------------------------------------------------------
def test_protobuf_is_read_only() -> None:
    """One codec writes a group (columnar); the protobuf module keeps no encoder for anyone to reach for."""
    assert not [name for name in vars(buffer.wire) if "encode" in name], "buffer.wire writes protobuf again"


@pytest.mark.parametrize("rich", [False, True])
def test_fast_decoding_matches_the_generated_decoder(rich: bool) -> None:
    data = encode_group(make_group(rich=rich, seed=3))
    fast, ref = decode_group_fast(data), decode_group(data)
    assert (fast.group_id, fast.prompt_id, fast.metadata) == (ref.group_id, ref.prompt_id, ref.metadata)
    for a, b in zip(fast.trajectories, ref.trajectories, strict=True):
        for name in ("prompt_token_ids", "completion_token_ids", "behavior_logprobs", "policy_versions", "loss_mask"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            assert getattr(a, name).dtype == getattr(b, name).dtype
        for name in (
            "id",
            "group_id",
            "reward",
            "reward_components",
            "finish_reason",
            "server_id",
            "metadata",
            "logprob_source",
            "started_at",
            "finished_at",
        ):
            assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize(
    "rare",
    [
        {"metadata": {"": "", "temperature": "0.7", "ünï": "cödé ✓"}, "reward_components": {"int": 2, "neg": -0.5}},
        {"started_at": 1.5e-9, "finished_at": 1763900003.000000001},  # nanos only; seconds with rounding
        {"started_at": -86400.25},  # before 1970: left to the generated classes both ways
        {"started_at": 1e12},  # past year 9999: the generated classes' call
    ],
)
def test_maps_and_timestamps_decode_as_the_generated_codec_does(rare: dict) -> None:
    group = make_group(seed=5)
    group.metadata = {"dataset_index": "7", "": "empty key"}
    for t in group.trajectories:
        for name, value in rare.items():
            setattr(t, name, value)
    try:
        generated = encode_group(group)
    except ValueError:  # a timestamp protobuf refuses: no such payload was ever written
        return
    fast, ref = decode_group_fast(generated), decode_group(generated)
    assert fast.metadata == ref.metadata
    for a, b in zip(fast.trajectories, ref.trajectories, strict=True):
        for name in ("metadata", "reward_components", "started_at", "finished_at"):
            assert getattr(a, name) == getattr(b, name), name


def test_a_corrupt_map_entry_is_an_invalid_trajectory() -> None:
    """A metadata entry whose key runs past its end: the fast decoder's rare-field parser must not leak
    protobuf's DecodeError (the reader dead-letters InvalidTrajectory; anything else would stop it)."""
    group = pb.TrajectoryGroup.FromString(encode_group(make_group(g=1)))
    body = group.trajectories[0].SerializeToString() + b"\x72\x03\x0a\x7f\x00"  # metadata: key of 127 B in 3
    data = b"\x0a\x07group-0" + b"\x1a" + bytes([len(body) & 0x7F | 0x80, len(body) >> 7]) + body
    assert 128 <= len(body) < 1 << 14  # the two-byte length above
    with pytest.raises(InvalidTrajectory):
        decode_group_fast(data)


def test_fast_decoder_defers_to_the_generated_parser_on_unknown_fields() -> None:
    msg = pb.TrajectoryGroup.FromString(encode_group(make_group()))
    data = msg.SerializeToString() + b"\xa2\x06\x03abc"  # field 100, length-delimited: unknown, legal
    assert decode_group_fast(data).group_id == "group-0"


def test_fast_decoder_keeps_the_contract_checks() -> None:
    msg = pb.TrajectoryGroup.FromString(encode_group(make_group()))
    msg.trajectories[1].loss_mask = msg.trajectories[1].loss_mask[:-1]
    with pytest.raises(InvalidTrajectory, match="loss_mask has 15 elements for 16"):
        decode_group_fast(msg.SerializeToString())
    msg = pb.TrajectoryGroup.FromString(encode_group(make_group()))
    msg.trajectories[0].group_id = "another"
    with pytest.raises(InvalidTrajectory, match="its group is"):
        decode_group_fast(msg.SerializeToString())
    msg.ClearField("trajectories")
    with pytest.raises(InvalidTrajectory, match="empty"):
        decode_group_fast(msg.SerializeToString())


def test_fast_decoder_hands_out_views_not_copies() -> None:
    data = encode_group(make_group(tokens=1024))
    t = decode_group_fast(data).trajectories[0]
    assert not t.completion_token_ids.flags.writeable  # a read-only view into the payload
    assert t.completion_token_ids.base is not None


# -- payloads ---------------------------------------------------------------------------------------------
def test_small_payloads_stay_uncompressed() -> None:
    codec, payload = encode_payload(make_group(), compression="zlib", compress_min_bytes=1 << 20)
    assert codec == CODEC_COLUMNAR
    assert decode_payload(codec, payload).group_id == "group-0"


def test_large_compressible_payloads_are_zlib_and_round_trip() -> None:
    group = make_group(tokens=4096)
    for t in group.trajectories:  # repetitive tokens compress; random log-probs would not
        t.completion_token_ids = np.zeros(4096, dtype=np.int32)
        t.behavior_logprobs = np.zeros(4096, dtype=np.float32)
    codec, payload = encode_payload(group, compression="zlib", compress_min_bytes=1024)
    assert codec == CODEC_COLUMNAR_ZLIB
    assert len(payload) < len(encode_group(group)) // 4
    back = decode_payload(codec, payload)
    np.testing.assert_array_equal(back.trajectories[2].policy_versions, group.trajectories[2].policy_versions)


def test_the_decoder_hands_out_the_columnar_bytes_it_read() -> None:
    """The bytes the learner forwards to its other ranks: the payload itself (the group's arrays view it),
    inflated when compressed, and none for a legacy protobuf payload (encoded afresh, columnar, if sent)."""
    group = make_group(tokens=256)
    plain = encode_columnar(group)[0]
    back, oldest, columnar = decode_group_columnar(CODEC_COLUMNAR, plain)
    assert columnar is plain and oldest == 1
    assert np.shares_memory(back.trajectories[0].completion_token_ids, np.frombuffer(plain, np.uint8))
    assert decode_group_columnar(CODEC_COLUMNAR_ZLIB, zlib.compress(plain))[2] == plain
    legacy, _, none = decode_group_columnar(CODEC_PROTOBUF, encode_group(group))
    assert none == b"" and legacy.group_id == group.group_id


def test_compression_never_grows_a_payload() -> None:
    for tokens in (1, 8, 64):
        group = make_group(tokens=tokens, g=1, seed=tokens)
        plain = encode_columnar(group)[0]
        codec, payload = encode_payload(group, compression="zlib", compress_min_bytes=0)
        assert len(payload) <= len(plain)
        assert codec == (CODEC_COLUMNAR_ZLIB if len(zlib.compress(plain, 1)) < len(plain) else CODEC_COLUMNAR)


@pytest.mark.parametrize(
    ("codec", "payload", "match"),
    [
        (CODEC_PROTOBUF, b"\xff\xfe garbage \x00\x01", "not a TrajectoryGroup"),
        (CODEC_PROTOBUF, pickle.dumps({"group_id": "x", "trajectories": []}), None),
        (CODEC_PROTOBUF_ZLIB, b"not zlib at all", "does not decompress"),
        (CODEC_PROTOBUF_ZLIB, zlib.compress(b"x" * 1000)[:-6], "truncated"),
        (CODEC_COLUMNAR, b"\xff\xfe garbage \x00\x01", "not a columnar trajectory group"),
        (CODEC_COLUMNAR_ZLIB, zlib.compress(b"TGC"), "shorter than"),
        (b"pickle", b"\x80\x04", "unknown payload codec"),
    ],
)
def test_bad_payloads_raise_invalid_trajectory(codec: bytes, payload: bytes, match: str | None) -> None:
    with pytest.raises(InvalidTrajectory, match=match):
        decode_payload(codec, payload)


def test_header_of_a_foreign_entry_never_raises() -> None:
    head = read_header({b"v": b"not-a-number", b"n": b"12x", b"g": b"\xff"})
    assert head.oldest_version is None
    assert head.nbytes == 0
    assert head.codec == b""
    assert read_header({b"v": b"4", b"n": b"100", b"c": b"pb", b"g": b"g1"}).oldest_version == 4


@pytest.mark.parametrize(
    "breakage",
    [
        lambda ts: setattr(ts[2], "id", ""),
        lambda ts: setattr(ts[1], "loss_mask", ts[1].loss_mask[:-1]),
        lambda ts: ts[3].completion_token_ids.__setitem__(4, -7),
        lambda ts: ts[0].prompt_token_ids.__setitem__(0, -1),
        lambda ts: ts[2].loss_mask.__setitem__(0, 2),
        lambda ts: ts[1].policy_versions.__setitem__(3, -1),
        lambda ts: (ts[3].loss_mask.__setitem__(0, 5), setattr(ts[1], "id", "")),  # the first in order wins
    ],
)
def test_group_validation_raises_what_validate_raises_in_order(breakage) -> None:
    ts = make_group(tokens=32).trajectories
    assert validate_group(ts) == 1
    breakage(ts)
    with pytest.raises(InvalidTrajectory) as expected:
        for t in ts:
            validate(t)
    with pytest.raises(InvalidTrajectory) as got:
        validate_group(ts)
    assert str(got.value) == str(expected.value)


def test_group_validation_of_large_groups_and_empty_completions() -> None:
    ts = make_group(tokens=40_000, g=2, version=5).trajectories  # past the concatenation threshold
    assert validate_group(ts) == 4
    ts[1].completion_token_ids[-1] = -1
    with pytest.raises(InvalidTrajectory, match="negative token id"):
        validate_group(ts)
    empty = make_group(tokens=0, g=2).trajectories
    assert validate_group(empty) == -1
