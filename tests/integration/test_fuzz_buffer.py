"""Malformed and foreign entries in the Redis streams: dead-lettered, never deserialised unsafely.

test_buffer_streams.py covers one garbage payload, one pickle and one entry with foreign fields. This
adds what an attacker with write access to Redis (or a buggy producer in another language) could
send: a pickle whose unpickling would create a file — inline, in a payload key and zlib-compressed,
in the trajectories and the prompts streams — valid protobufs of the wrong message type, entries of an
unknown codec (the protobuf ``pb``/``pbz`` groups of development builds among them), a zlib bomb, and
hypothesis-generated entries and byte-flipped real payloads. Nothing may raise out of the
reader, nothing may be executed, and every entry ends in exactly one ledger counter.
"""

from __future__ import annotations

import pickle  # only to build the attacker's payload; the project itself never imports it
import uuid
import zlib
from pathlib import Path

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from buffer import PromptQueue, RedisKeys, TrajectoryReader, TrajectoryWriter, buffer_stats
from buffer.codec import CODEC_COLUMNAR, CODEC_COLUMNAR_ZLIB, decode_group_payload, encode_payload
from tests.integration.test_fuzz_grpc import FUZZ
from tests.unit.test_buffer_codec import make_group
from tether.config.buffer import BufferConfig
from tether.trajectory import InvalidTrajectory
from tether.v1 import control_pb2, reward_pb2, trajectory_pb2


class _Touch:
    """Unpickling this opens ``path`` for writing, i.e. creates the file: proof that code ran."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def evil_pickle(path: Path) -> bytes:
    return pickle.dumps(_Touch(path), protocol=pickle.HIGHEST_PROTOCOL)


@pytest.fixture
def client(redis_url: str):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def fresh_keys() -> RedisKeys:
    return RedisKeys(f"fz{uuid.uuid4().hex[:8]}")


def cfg() -> BufferConfig:
    return BufferConfig(claim_idle_ms=200, put_timeout_s=0.3)


def drain(client: redis.Redis, keys: RedisKeys) -> list[str]:
    """Read everything as a learner would; the group ids delivered. Every entry is settled exactly once."""
    entries = client.xlen(keys.trajectories)
    reader = TrajectoryReader(client, keys, cfg())
    got = reader.read(1000, current_version=10**6, max_staleness=10**9, block_ms=100)
    reader.ack([b.entry_id for b in got])
    s = buffer_stats(client, keys)
    # Hand-written entries never counted as produced, so balance against what was in the stream.
    assert s["buffer/acknowledged"] + s["buffer/dropped_stale"] + s["buffer/dead_letter"] == entries, s
    assert (s["buffer/depth"], s["buffer/pending"]) == (0, 0), s
    return [b.group.group_id for b in got]


def test_the_bait_is_live(tmp_path: Path) -> None:
    """The payload really does run code when unpickled, so its absence below means something."""
    marker = tmp_path / "control"
    pickle.loads(evil_pickle(marker)).close()
    assert marker.exists()


def test_pickles_are_dead_lettered_and_never_unpickled(client: redis.Redis, tmp_path: Path) -> None:
    keys, marker = fresh_keys(), tmp_path / "pwned"
    bait = evil_pickle(marker)
    writer = TrajectoryWriter(client, keys, cfg())
    writer.put(make_group(seed=0))
    client.xadd(keys.trajectories, {"g": "inline", "v": "1", "c": "col", "n": str(len(bait)), "d": bait})
    client.xadd(keys.trajectories, {"g": "zlib", "v": "1", "c": "colz", "d": zlib.compress(bait)})
    client.xadd(keys.trajectories, {"g": "pickle-codec", "v": "1", "c": "pickle", "d": bait})
    client.set(keys.payload("n1"), bait)
    client.xadd(keys.trajectories, {"g": "keyed", "v": "1", "c": "col", "n": str(len(bait)), "k": "n1"})
    writer.put(make_group(seed=1))
    assert drain(client, keys) == ["group-0", "group-1"]
    dead = client.xrange(keys.dead_letter)
    # Under the columnar tags (inline, inflated, keyed) the decoder saw the pickle and refused it; under a tag of
    # its own, the tag was refused.
    refused, unknown = b"undecodable: not a columnar trajectory group", b"undecodable: unknown payload codec b'pickle'"
    reasons = [f[b"reason"] for _, f in dead]
    assert len(reasons) == 4, reasons
    for reason, want in zip(reasons, [refused, refused, unknown, refused], strict=True):
        assert reason.startswith(want), reason
    assert not marker.exists()

    queue = PromptQueue(client, keys, claim_idle_ms=100)
    client.xadd(keys.prompts, {"p": bait})
    client.xadd(keys.prompts, {"p": trajectory_pb2.Prompt(prompt_id="ok", text="q").SerializeToString()})
    got = queue.read("server-a", count=10, block_ms=100)
    assert not marker.exists()
    # A pickle is not a protobuf; if it ever parsed as one, it is inert data, never code.
    assert "ok" in [p.prompt_id for _, p in got]


@pytest.mark.parametrize(
    "payload",
    [
        trajectory_pb2.Prompt(prompt_id="p", text="x", token_ids=[1, 2]).SerializeToString(),
        control_pb2.CommitWeightUpdateRequest(version=3, update_id="u").SerializeToString(),
        reward_pb2.ScoreRequest(prompt="p", completion="c", reward_context={"a": "b"}).SerializeToString(),
        control_pb2.WeightUpdatePlan(version=3, update_id="u", filesystem={"path": "/"}).SerializeToString(),
        reward_pb2.ScoreResponse().SerializeToString(),
        b"",
    ],
    ids=["prompt", "commit-request", "score-request", "weight-plan", "empty-message", "empty"],
)
@pytest.mark.parametrize("codec", [b"col", b"pb"])
def test_wrong_message_types_are_dead_lettered(client: redis.Redis, payload: bytes, codec: bytes) -> None:
    """Under the columnar tag the decoder refuses them; under the protobuf ``pb`` tag of development builds
    (no longer read) the tag alone is refused. Either way: dead-lettered with the reason, and counted."""
    keys = fresh_keys()
    client.xadd(keys.trajectories, {"g": "foreign", "v": "1", "c": codec, "d": payload})
    assert drain(client, keys) == []
    ((_, dead),) = client.xrange(keys.dead_letter)
    want = b"not a columnar trajectory group" if codec == b"col" else b"unknown payload codec b'pb'"
    assert dead[b"reason"].startswith(b"undecodable: " + want), dead[b"reason"]
    assert buffer_stats(client, keys)["buffer/dead_letter"] == 1


def test_zlib_bomb_is_refused_without_inflating_it() -> None:
    # 64 MiB of zeros in about 64 KiB; the decoder must stop at its limit or at the columnar parse.
    bomb = zlib.compress(b"\x00" * (64 << 20), 9)
    with pytest.raises(InvalidTrajectory, match="not a columnar trajectory group"):
        decode_group_payload(CODEC_COLUMNAR_ZLIB, bomb)


@FUZZ
@given(
    data=st.one_of(st.binary(max_size=2048), st.binary(max_size=2048).map(lambda b: b"TGC\x01" + b)),
    codec=st.sampled_from([b"col", b"colz", b"pb", b"pbz", b"", b"pickle", b"\xff"]),
)
def test_decoder_raises_only_invalid_trajectory(data: bytes, codec: bytes) -> None:
    try:
        group, _ = decode_group_payload(codec, zlib.compress(data) if codec in (b"pbz", b"colz") else data)
        assert codec in (CODEC_COLUMNAR, CODEC_COLUMNAR_ZLIB)  # any other tag is refused, whatever the bytes
    except InvalidTrajectory:
        return
    assert group.group_id  # a random blob that parses must still be a whole, valid group


_VALID = {
    CODEC_COLUMNAR: bytes(encode_payload(make_group(seed=3))[1]),
    CODEC_COLUMNAR_ZLIB: zlib.compress(bytes(encode_payload(make_group(seed=3))[1])),
}


@FUZZ
@given(
    codec=st.sampled_from(list(_VALID)),
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=8),
)
def test_byte_flipped_payloads(codec: bytes, flips: list[tuple[int, int]]) -> None:
    """Corruption of a real payload (a bad disk, a truncated copy) is caught, not half-decoded into a crash:
    columnar payloads, plain and zlib-compressed."""
    data = bytearray(_VALID[codec])
    for pos, xor in flips:
        data[pos % len(data)] ^= xor
    try:
        group, _ = decode_group_payload(codec, bytes(data))
    except InvalidTrajectory:
        return
    for t in group.trajectories:  # what decodes is self-consistent
        assert len(t.completion_token_ids) == len(t.behavior_logprobs) == len(t.policy_versions) == len(t.loss_mask)


_FIELD = st.sampled_from([b"g", b"v", b"c", b"n", b"k", b"d", b"x", b"\x00"])
_VALUE = st.one_of(
    st.binary(max_size=64), st.sampled_from([b"col", b"colz", b"pb", b"pbz", b"-1", b"99999999999999999999", b"nan"])
)


@FUZZ
@given(entries=st.lists(st.dictionaries(_FIELD, _VALUE, min_size=1, max_size=6), min_size=1, max_size=5))
def test_random_stream_entries_never_stop_the_reader(client: redis.Redis, entries: list[dict]) -> None:
    keys = fresh_keys()
    writer = TrajectoryWriter(client, keys, cfg())
    writer.put(make_group(seed=0))
    for fields in entries:
        client.xadd(keys.trajectories, fields)
    writer.put(make_group(seed=1))
    delivered = drain(client, keys)
    assert delivered[0] == "group-0" and delivered[-1] == "group-1"
    client.delete(keys.trajectories, keys.dead_letter)


def test_a_huge_byte_count_does_not_wedge_the_reader(client: redis.Redis) -> None:
    """Found by the fuzz above: ``n`` of 1e17 broke the settle script (Lua floats), so every read failed."""
    keys = fresh_keys()
    client.xadd(keys.trajectories, {"g": "huge", "v": "1", "c": "col", "n": b"99999999999999992", "d": b"\xff"})
    TrajectoryWriter(client, keys, cfg()).put(make_group(seed=0))
    assert drain(client, keys) == ["group-0"]
    assert buffer_stats(client, keys)["buffer/bytes"] == 0
