"""Pure logic of the buffer's serialization: payload encoding, compression, codec tags, entry headers."""

from __future__ import annotations

import pickle
import zlib

import numpy as np
import pytest

from buffer.codec import (
    CODEC_COLUMNAR,
    CODEC_COLUMNAR_ZLIB,
    decode_group_columnar,
    decode_payload,
    encode_payload,
    read_header,
)
from buffer.columnar import encode_columnar
from tether.trajectory import GroupData, InvalidTrajectory, TrajectoryData
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
    assert len(payload) < len(encode_columnar(group)[0]) // 4
    back = decode_payload(codec, payload)
    np.testing.assert_array_equal(back.trajectories[2].policy_versions, group.trajectories[2].policy_versions)


def test_the_decoder_hands_out_the_columnar_bytes_it_read() -> None:
    """The bytes the learner forwards to its other ranks: the payload itself (the group's arrays view it),
    inflated when compressed."""
    group = make_group(tokens=256)
    plain = encode_columnar(group)[0]
    back, oldest, columnar = decode_group_columnar(CODEC_COLUMNAR, plain)
    assert columnar is plain and oldest == 1
    assert np.shares_memory(back.trajectories[0].completion_token_ids, np.frombuffer(plain, np.uint8))
    assert decode_group_columnar(CODEC_COLUMNAR_ZLIB, zlib.compress(plain))[2] == plain


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
        (CODEC_COLUMNAR, b"\xff\xfe garbage \x00\x01", "not a columnar trajectory group"),
        (CODEC_COLUMNAR, pickle.dumps({"group_id": "x", "trajectories": []}), "not a columnar trajectory group"),
        (CODEC_COLUMNAR_ZLIB, b"not zlib at all", "does not decompress"),
        (CODEC_COLUMNAR_ZLIB, zlib.compress(b"x" * 1000)[:-6], "truncated"),
        (CODEC_COLUMNAR_ZLIB, zlib.compress(b"TGC"), "shorter than"),
        (b"pickle", b"\x80\x04", "unknown payload codec b'pickle'"),
        # The protobuf groups of development builds before the columnar codec: no longer read, and said so.
        (b"pb", b"\x0a\x07group-0\x12\x031-0", r"unknown payload codec b'pb' \(this reader knows b'col', b'colz'\)"),
        (b"pbz", zlib.compress(b"\x0a\x07group-0"), "unknown payload codec b'pbz'"),
    ],
)
def test_bad_payloads_raise_invalid_trajectory(codec: bytes, payload: bytes, match: str) -> None:
    with pytest.raises(InvalidTrajectory, match=match):
        decode_payload(codec, payload)


def test_header_of_a_foreign_entry_never_raises() -> None:
    head = read_header({b"v": b"not-a-number", b"n": b"12x", b"g": b"\xff"})
    assert head.oldest_version is None
    assert head.nbytes == 0
    assert head.codec == b""
    assert read_header({b"v": b"4", b"n": b"100", b"c": b"pb", b"g": b"g1"}).oldest_version == 4
