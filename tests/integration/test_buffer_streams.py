"""The buffer against a real Redis, once on 6.2 and once on 7.x: delivery, idempotency, staleness,
dead letters, backpressure, prompts, registry and stats."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest
import redis

from buffer import (
    BufferFull,
    PromptQueue,
    RedisKeys,
    ServerInfo,
    ServerRegistry,
    TrajectoryReader,
    TrajectoryWriter,
    buffer_stats,
    publish_version,
    read_version,
)
from buffer.columnar import encode_columnar
from tests.unit.test_buffer_codec import make_group
from tether.config.buffer import BufferConfig
from tether.trajectory import InvalidTrajectory
from tether.v1.trajectory_pb2 import Prompt

KEYS = RedisKeys("t")


@pytest.fixture
def client(versioned_redis_url: str):
    c = redis.Redis.from_url(versioned_redis_url)
    yield c
    c.close()


def cfg(**kw) -> BufferConfig:
    return BufferConfig(**({"claim_idle_ms": 200, "put_timeout_s": 0.3} | kw))


def assert_balanced(client: redis.Redis) -> dict[str, float]:
    """Every produced group is acknowledged, dropped stale, dead-lettered, or still in the stream."""
    s = buffer_stats(client, KEYS)
    assert s["buffer/produced"] == (
        s["buffer/acknowledged"] + s["buffer/dropped_stale"] + s["buffer/dead_letter"] + s["buffer/depth"]
    ), s
    return s


def test_put_read_ack_round_trip(client: redis.Redis) -> None:
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    ids = [writer.put(make_group(seed=i, version=3)) for i in range(3)]
    got = reader.read(3, current_version=4, max_staleness=2, block_ms=500)
    assert [b.entry_id for b in got] == ids
    assert [b.group.group_id for b in got] == ["group-0", "group-1", "group-2"]
    assert [b.staleness for b in got] == [2, 2, 2]  # the oldest tokens are v2
    assert got[1].group.trajectories[2].reward == 2.0
    reader.ack([b.entry_id for b in got])
    reader.ack([b.entry_id for b in got])  # a repeated ack counts once
    s = assert_balanced(client)
    assert (s["buffer/acknowledged"], s["buffer/depth"], s["buffer/bytes"]) == (3, 0, 0)
    assert s["buffer/consumed"] == 3
    assert s["buffer/staleness/2"] == 3
    assert client.xlen(KEYS.trajectories) == 0  # acknowledged entries are deleted: memory stays bounded
    assert client.keys(KEYS.payload("*")) == []  # and so are their payloads


def test_retried_insert_makes_exactly_one_entry(client: redis.Redis) -> None:
    writer = TrajectoryWriter(client, KEYS, cfg())
    group = make_group(seed=7)
    first = writer.put(group)
    assert first is not None
    assert writer.put(group) is None
    assert TrajectoryWriter(client, KEYS, cfg()).put(make_group(seed=7)) is None  # another producer, same id
    assert client.xlen(KEYS.trajectories) == 1
    assert len(client.keys(KEYS.payload("*"))) == 1  # the retries' payloads were dropped, not leaked
    s = buffer_stats(client, KEYS)
    assert (s["buffer/produced"], s["buffer/duplicates"]) == (1, 2)


def test_put_many_is_one_round_trip_of_separate_idempotent_inserts(client: redis.Redis) -> None:
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    assert writer.put(make_group(seed=1, version=3)) is not None  # inserted before the batch
    groups = [make_group(seed=i, version=3) for i in (0, 1, 2, 0)]  # one known id, one repeated in the batch
    execs = client.info("commandstats").get("cmdstat_exec", {}).get("calls", 0)
    ids = writer.put_many(groups)
    assert client.info("commandstats")["cmdstat_exec"]["calls"] == execs + 1  # all four in one MULTI/EXEC
    assert [i is not None for i in ids] == [True, False, True, False]
    assert len(client.keys(KEYS.payload("*"))) == 3  # the duplicates' payloads were dropped, not leaked
    s = buffer_stats(client, KEYS)
    assert (s["buffer/produced"], s["buffer/duplicates"], s["buffer/depth"]) == (3, 2, 3)
    got = reader.read(3, current_version=3, max_staleness=2, block_ms=500)
    assert [b.group.group_id for b in got] == ["group-1", "group-0", "group-2"]
    for t, w in zip(got[2].group.trajectories, groups[2].trajectories, strict=True):
        np.testing.assert_array_equal(t.behavior_logprobs, w.behavior_logprobs)
        np.testing.assert_array_equal(t.completion_token_ids, w.completion_token_ids)
        assert (t.id, t.reward) == (w.id, w.reward)
    assert writer.put_many([]) == []


def test_large_payloads_go_as_their_own_buffers_and_arrive_whole(client: redis.Redis) -> None:
    """Payloads of 256 KiB and more are sent without being copied into the transaction's buffer: the
    buffers still carry every byte in order, and the groups read back equal."""
    from buffer.writer import _SEND_ALONE, _coalesce

    big, small = b"x" * _SEND_ALONE, [b"a", b"bc"]
    assert _coalesce([*small, big, *small, b"d"]) == [b"abc", big, b"abcd"]
    assert _coalesce(small) == [b"abc"] and _coalesce([big]) == [big]
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    groups = [make_group(seed=i, tokens=40_000, version=3) for i in range(2)]  # ~2 MB payloads
    ids = writer.put_many([groups[0], make_group(seed=5, version=3), groups[1]])
    assert all(i is not None for i in ids)
    got = {b.group.group_id: b.group for b in reader.read(3, current_version=3, max_staleness=1, block_ms=500)}
    for g in groups:
        for t, w in zip(got[g.group_id].trajectories, g.trajectories, strict=True):
            np.testing.assert_array_equal(t.completion_token_ids, w.completion_token_ids)
            np.testing.assert_array_equal(t.behavior_logprobs, w.behavior_logprobs)


def test_put_many_refuses_a_malformed_group_before_inserting_any(client: redis.Redis) -> None:
    writer = TrajectoryWriter(client, KEYS, cfg())
    bad = make_group(seed=1)
    bad.trajectories[0].loss_mask = bad.trajectories[0].loss_mask[:-1]
    with pytest.raises(InvalidTrajectory):
        writer.put_many([make_group(seed=0), bad])
    assert client.xlen(KEYS.trajectories) == 0
    assert client.keys(KEYS.payload("*")) == []


def test_put_many_keeps_the_bound_group_by_group(client: redis.Redis) -> None:
    c = cfg(max_trajectory_groups=3, max_trajectory_bytes=10**9, put_timeout_s=0.1)
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    batch = [make_group(seed=i) for i in range(5)]
    with pytest.raises(BufferFull, match="3 unacknowledged groups") as full:
        writer.put_many(batch)
    assert client.xlen(KEYS.trajectories) == 3  # the groups before the full one are in, whole
    # The error says which groups the batch did insert (their stream ids), so no caller retries them.
    entries = [eid.decode() for eid, _ in client.xrange(KEYS.trajectories)]
    assert full.value.decided == dict(enumerate(entries))
    assert len(client.keys(KEYS.payload("*"))) == 3  # nothing left behind by the ones that did not fit
    assert assert_balanced(client)["buffer/produced"] == 3
    reader.ack([b.entry_id for b in reader.read(3, current_version=2, max_staleness=1, block_ms=300)])
    assert [i is None for i in writer.put_many(batch)] == [True, True, True, False, False]  # the retry
    assert assert_balanced(client)["buffer/produced"] == 5


def test_one_settle_counts_each_entry_once_whatever_the_mix(client: redis.Redis) -> None:
    # The deletes and the histogram are sent once per batch: repeated ids in one ack, two staleness
    # values and an unknown id must still count exactly once each.
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    for i, v in enumerate([5, 4, 5, 4, 5]):
        writer.put(make_group(seed=i, version=v))
    got = reader.read(5, current_version=6, max_staleness=4, block_ms=300)
    assert sorted(b.staleness for b in got) == [2, 2, 2, 3, 3]
    ids = [b.entry_id for b in got]
    reader.ack([ids[0], ids[1], ids[0], "1-1", ids[2]])
    assert client.xlen(KEYS.trajectories) == 2
    reader.ack(ids + ids)
    s = assert_balanced(client)
    assert (s["buffer/acknowledged"], s["buffer/depth"], s["buffer/bytes"]) == (5, 0, 0)
    assert (s["buffer/staleness/2"], s["buffer/staleness/3"]) == (3, 2)
    assert client.keys(KEYS.payload("*")) == []


def test_one_settle_of_more_entries_than_one_delete_call_takes(client: redis.Redis) -> None:
    # SETTLE deletes in slices of 1000 (one unpack() of more than about 8000 fails): an ack of 8200 entries
    # it did not read itself (sizes and payload keys looked up in the entries) deletes every entry and
    # payload and counts each once.
    reader = TrajectoryReader(client, KEYS, cfg())
    pipe = client.pipeline(transaction=False)
    for i in range(8200):
        pipe.set(KEYS.payload(f"n{i}"), b"x")
        pipe.xadd(KEYS.trajectories, {"g": f"g{i}", "v": "1", "c": "col", "n": "1", "k": f"n{i}"})
    pipe.hset(KEYS.counters, mapping={"produced": 8200, "bytes": 8200})
    pipe.execute()
    got = client.xreadgroup("learner", "other", {KEYS.trajectories: ">"}, count=10_000)
    reader.ack([eid.decode() for eid, _ in got[0][1]])
    s = assert_balanced(client)
    assert (s["buffer/acknowledged"], s["buffer/depth"], s["buffer/bytes"]) == (8200, 0, 0)
    assert client.keys(KEYS.payload("*")) == []


def test_stale_groups_are_dropped_and_counted(client: redis.Redis) -> None:
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    writer.put(make_group(seed=0, version=1))  # oldest token v0: 5 versions behind
    writer.put(make_group(seed=1, version=5))  # oldest token v4: 1 behind
    got = reader.read(2, current_version=5, max_staleness=2, block_ms=300)
    assert [b.group.group_id for b in got] == ["group-1"]
    assert got[0].staleness == 1
    reader.ack([got[0].entry_id])
    s = assert_balanced(client)
    assert s["buffer/dropped_stale"] == 1
    assert s["buffer/staleness/1"] == 1
    assert s["buffer/bytes"] == 0


def test_corrupt_entries_are_dead_lettered_while_others_flow(client: redis.Redis) -> None:
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    writer.put(make_group(seed=0))
    client.xadd(KEYS.trajectories, {"g": "bad-1", "v": "2", "c": "col", "n": "9", "d": b"\xff\x00garbage"})
    client.xadd(KEYS.trajectories, {"g": "bad-2", "c": "col", "d": pickle.dumps({"group_id": "x"})})
    client.xadd(KEYS.trajectories, {"something": "else"})
    writer.put(make_group(seed=1))
    got = reader.read(5, current_version=2, max_staleness=1, block_ms=300)
    assert [b.group.group_id for b in got] == ["group-0", "group-1"]
    reader.ack([b.entry_id for b in got])
    dead = client.xrange(KEYS.dead_letter)
    assert len(dead) == 3
    reasons = [fields[b"reason"].decode() for _, fields in dead]
    assert all(r.startswith("undecodable") for r in reasons), reasons
    assert dead[0][1][b"d"] == b"\xff\x00garbage"  # the payload is kept for inspection
    s = buffer_stats(client, KEYS)
    assert (s["buffer/dead_letter"], s["buffer/acknowledged"], s["buffer/depth"]) == (3, 2, 0)
    assert s["buffer/bytes"] == 0


def test_older_and_newer_payload_formats(client: redis.Redis) -> None:
    """An entry in the protobuf codec of development builds (``pb``, no longer read) and a columnar payload of
    a version this reader does not know are dead-lettered saying so, counted, their bytes and payload keys
    released, and the entries around them flow."""
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    old = b"\x0a\x07group-5\x12\x031-0"  # how a protobuf TrajectoryGroup began: its group and prompt ids
    client.set(KEYS.payload("old-1"), old)
    client.xadd(KEYS.trajectories, {"g": "group-5", "v": "1", "c": "pb", "n": len(old), "k": "old-1"})
    newer = bytes(encode_columnar(make_group(seed=6))[0])
    newer = newer[:3] + b"\x02" + newer[4:]
    client.xadd(KEYS.trajectories, {"g": "group-6", "v": "1", "c": "col", "n": len(newer), "d": newer})
    writer.put(make_group(seed=7))
    got = reader.read(3, current_version=2, max_staleness=1, block_ms=300)
    assert [b.group.group_id for b in got] == ["group-7"]
    np.testing.assert_array_equal(got[0].group.trajectories[2].behavior_logprobs,
                                  make_group(seed=7).trajectories[2].behavior_logprobs)  # fmt: skip
    reader.ack([b.entry_id for b in got])
    reasons = [fields[b"reason"] for _, fields in client.xrange(KEYS.dead_letter)]
    assert [r.decode() for r in reasons] == [
        "undecodable: unknown payload codec b'pb' (this reader knows b'col', b'colz')",
        "undecodable: columnar payload version 2; this reader knows version 1 — upgrade the learner to read "
        "entries written by newer rollout servers",
    ]
    s = buffer_stats(client, KEYS)
    assert (s["buffer/dead_letter"], s["buffer/acknowledged"], s["buffer/depth"], s["buffer/bytes"]) == (2, 1, 0, 0)
    assert client.keys(KEYS.payload("*")) == []  # the old entry's payload key went with its dead letter


def test_entries_delivered_too_often_are_dead_lettered(client: redis.Redis) -> None:
    c = cfg(max_deliveries=2, claim_idle_ms=1)
    TrajectoryWriter(client, KEYS, c).put(make_group(seed=0))
    for attempt in range(2):  # two learners that each read it and die before acknowledging
        got = TrajectoryReader(client, KEYS, c, consumer=f"dead-{attempt}").read(
            1, current_version=2, max_staleness=1, block_ms=300
        )
        assert len(got) == 1
        time.sleep(0.01)
    survivor = TrajectoryReader(client, KEYS, c, consumer="survivor")
    survivor.recover()
    assert survivor.read(1, current_version=2, max_staleness=1, block_ms=100) == []
    s = assert_balanced(client)
    assert s["buffer/dead_letter"] == 1
    assert b"delivered 3 times" in client.xrange(KEYS.dead_letter)[0][1][b"reason"]


def test_restarted_learner_recovers_what_it_had_not_acknowledged(client: redis.Redis) -> None:
    c = cfg(claim_idle_ms=60_000)
    writer = TrajectoryWriter(client, KEYS, c)
    for i in range(3):
        writer.put(make_group(seed=i))
    first = TrajectoryReader(client, KEYS, c, consumer="learner-0")
    got = first.read(2, current_version=2, max_staleness=1, block_ms=300)
    first.ack([got[0].entry_id])
    restarted = TrajectoryReader(client, KEYS, c, consumer="learner-0")  # same name, fresh process state
    # Both others: the one handed out and not acknowledged, and the one read ahead (the reader takes all
    # that is there, so it can hand out the oldest first).
    assert restarted.recover() == 2
    again = restarted.read(2, current_version=2, max_staleness=1, block_ms=300)
    assert [b.group.group_id for b in again] == ["group-1", "group-2"]  # the unacknowledged one first
    restarted.ack([b.entry_id for b in again])
    s = assert_balanced(client)
    assert (s["buffer/acknowledged"], s["buffer/depth"], s["buffer/pending"]) == (3, 0, 0)


def test_backpressure_with_a_stalled_consumer(client: redis.Redis) -> None:
    c = cfg(max_trajectory_groups=4, max_trajectory_bytes=10**9, put_timeout_s=0.2)
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    for i in range(4):
        writer.put(make_group(seed=i))
    reader.read(2, current_version=2, max_staleness=1, block_ms=300)  # read, then the learner stalls
    with pytest.raises(BufferFull, match="4 unacknowledged groups"):
        writer.put(make_group(seed=99))
    for _ in range(3):  # producers keep retrying; Redis does not grow
        with pytest.raises(BufferFull):
            writer.put(make_group(seed=100), timeout_s=0.05)
    assert client.xlen(KEYS.trajectories) == 4
    assert len(client.keys(KEYS.payload("*"))) == 4  # a producer that gave up leaves no payload behind
    s = assert_balanced(client)
    assert s["buffer/produced"] == 4
    assert s["buffer/pending"] == 4  # two handed out, two read ahead: all on the learner's side now
    got = reader.read(2, current_version=2, max_staleness=1, block_ms=300)
    reader.ack([b.entry_id for b in got])  # room again
    assert writer.put(make_group(seed=99)) is not None


def test_byte_bound(client: redis.Redis) -> None:
    one = len(make_group(tokens=256).trajectories) * 256 * 13
    c = cfg(max_trajectory_bytes=int(one * 1.5), put_timeout_s=0.1)
    writer = TrajectoryWriter(client, KEYS, c)
    assert writer.put(make_group(tokens=256, seed=0)) is not None
    with pytest.raises(BufferFull, match="max_trajectory_bytes"):
        writer.put(make_group(tokens=256, seed=1))
    assert buffer_stats(client, KEYS)["buffer/bytes"] > one


def test_prompt_admission_and_reclaim(client: redis.Redis) -> None:
    q = PromptQueue(client, KEYS, claim_idle_ms=100)
    source = iter([Prompt(prompt_id=str(i), dataset_index=i, text=f"q{i}") for i in range(100)])
    assert q.feed(source, version=0, prompts_per_version=4, max_staleness=1) == 8
    assert q.feed(source, version=0, prompts_per_version=4, max_staleness=1) == 0
    assert q.issued() == 8
    assert next(source).dataset_index == 8  # the feed took no more from the dataset than it issued
    held = q.read("server-a", count=3, block_ms=200)
    assert [p.dataset_index for _, p in held] == [0, 1, 2]
    assert held[0][1].issued_at_version == 0
    q.ack([held[0][0]])
    time.sleep(0.15)  # server-a died holding two prompts
    reclaimed = q.read("server-b", count=5, block_ms=200)
    assert [p.dataset_index for _, p in reclaimed] == [1, 2]
    assert q.feed(source, version=1, prompts_per_version=4, max_staleness=1) == 4
    client.xadd(KEYS.prompts, {"p": b"\xff\xff not a prompt"})
    fresh = q.read("server-b", count=10, block_ms=200)
    assert [p.dataset_index for _, p in fresh] == [3, 4, 5, 6, 7, 9, 10, 11, 12]
    assert buffer_stats(client, KEYS)["buffer/prompts_dead_letter"] == 1


def test_version_and_registry(client: redis.Redis) -> None:
    assert read_version(client, KEYS) == 0
    publish_version(client, KEYS, 3)
    assert read_version(client, KEYS) == 3
    reg = ServerRegistry(client, KEYS)
    reg.heartbeat(ServerInfo("a", address="127.0.0.1:5001", engine="transformers", policy_version=3), ttl_s=30)
    reg.heartbeat(ServerInfo("b", address="127.0.0.1:5002", engine="vllm", extra={"gpu": 1}), ttl_s=0.2)
    live = reg.live()
    assert [(s.server_id, s.address, s.engine) for s in live] == [
        ("a", "127.0.0.1:5001", "transformers"),
        ("b", "127.0.0.1:5002", "vllm"),
    ]
    assert live[1].extra == {"gpu": 1}
    assert 0 <= live[0].heartbeat_age_s < 30
    time.sleep(0.3)  # b stops heartbeating
    assert [s.server_id for s in reg.live()] == ["a"]
    assert client.smembers(KEYS.servers) == {b"a"}  # the expired id was pruned from the index
    reg.remove("a")
    assert reg.live() == []


def test_stats_before_anything_exists(client: redis.Redis) -> None:
    s = buffer_stats(client, KEYS)
    assert s["buffer/depth"] == 0
    assert s["buffer/oldest_age_s"] == 0
    assert s["buffer/pending"] == 0
    assert s["buffer/staleness_max"] == 0


def test_oldest_age_uses_the_oldest_entry(client: redis.Redis) -> None:
    writer = TrajectoryWriter(client, KEYS, cfg())
    writer.put(make_group(seed=0))
    time.sleep(0.05)
    writer.put(make_group(seed=1))
    s = buffer_stats(client, KEYS)
    assert s["buffer/depth"] == 2
    assert s["buffer/oldest_age_s"] >= 0.04


def test_a_waiting_producer_gets_in_when_room_appears(client: redis.Redis) -> None:
    import threading

    c = cfg(max_trajectory_groups=1, put_timeout_s=5.0)
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    writer.put(make_group(seed=0))
    result: list = []
    waiting = threading.Thread(target=lambda: result.append(TrajectoryWriter(client, KEYS, c).put(make_group(seed=1))))
    waiting.start()
    time.sleep(0.1)
    assert len(client.keys(KEYS.payload("*"))) == 2  # the waiting group's payload is already in Redis
    got = reader.read(1, current_version=2, max_staleness=1, block_ms=300)
    reader.ack([got[0].entry_id])
    waiting.join(timeout=5)
    assert result and result[0] is not None
    assert [b.group.group_id for b in reader.read(1, current_version=2, max_staleness=1, block_ms=300)] == ["group-1"]
    assert_balanced(client)


def test_an_entry_whose_payload_is_gone_is_dead_lettered(client: redis.Redis) -> None:
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    writer.put(make_group(seed=0))
    writer.put(make_group(seed=1))
    client.delete(client.keys(KEYS.payload("*"))[0])  # e.g. evicted by an allkeys maxmemory policy
    got = reader.read(2, current_version=2, max_staleness=1, block_ms=300)
    assert len(got) == 1
    reader.ack([got[0].entry_id])
    ((_, dead),) = client.xrange(KEYS.dead_letter)
    assert dead[b"reason"].startswith(b"undecodable: payload key")
    s = assert_balanced(client)
    assert (s["buffer/dead_letter"], s["buffer/bytes"]) == (1, 0)
    assert client.keys(KEYS.payload("*")) == []


def test_every_settled_group_is_booked_by_length_and_counter(client: redis.Redis) -> None:
    """Trained groups and stale ones (dropped from the header alone) each land in the length book under
    their counter, so the generated and trained length distributions can be compared."""
    c = cfg(max_deliveries=1)
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    writer.put(make_group(seed=0, tokens=4, g=3, version=5))  # fresh, short: trained
    writer.put(make_group(seed=1, tokens=200, g=2, version=1))  # stale, long: dropped unread
    got = reader.read(2, current_version=5, max_staleness=1, block_ms=300)
    assert [b.group.group_id for b in got] == ["group-0"]
    reader.ack([b.entry_id for b in got])
    s = assert_balanced(client)
    assert s["buffer/length_mean_generated"] == pytest.approx((3 * 4 + 2 * 200) / 5)
    assert s["buffer/length_mean_trained"] == 4.0
    assert s["buffer/length_drop_rate/4-5"] == 0.0
    assert s["buffer/length_drop_rate/182-255"] == 1.0
    assert s["buffer/length_tv"] == pytest.approx(0.4)
    book = {k.decode(): int(v) for k, v in client.hgetall(KEYS.lengths).items()}
    assert book == {"acknowledged:5": 3, "acknowledged:tokens": 12, "dropped_stale_env:16": 2,
                    "dropped_stale_env:tokens": 400}  # fmt: skip
    reader.ack([b.entry_id for b in got])  # a repeated ack books nothing twice
    assert {k.decode(): int(v) for k, v in client.hgetall(KEYS.lengths).items()} == book


def test_the_oldest_available_group_is_taken_first_not_the_first_to_arrive(client: redis.Redis) -> None:
    """A long completion arrives after shorter ones admitted later; read in arrival order it would wait
    behind them until it was too old to train on."""
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    for seed, version in enumerate((6, 6, 4, 5)):  # oldest tokens: v5, v5, v3, v4
        writer.put(make_group(seed=seed, version=version))
    got = reader.read(2, current_version=6, max_staleness=3, block_ms=300)
    assert [b.group.group_id for b in got] == ["group-2", "group-3"]
    assert [b.staleness for b in got] == [3, 2]
    reader.ack([b.entry_id for b in got])
    rest = reader.read(2, current_version=6, max_staleness=3, block_ms=300)
    assert [b.group.group_id for b in rest] == ["group-0", "group-1"]
    reader.ack([b.entry_id for b in rest])
    s = assert_balanced(client)
    assert (s["buffer/acknowledged"], s["buffer/consumed"], s["buffer/pending"]) == (4, 4, 0)


def test_a_group_given_back_is_handed_out_again_or_dropped_once_stale(client: redis.Redis) -> None:
    c = cfg()
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    for seed, version in enumerate((3, 4, 5, 4)):  # oldest tokens: v2, v3, v4, v3
        writer.put(make_group(seed=seed, version=version))
    got = reader.read(3, current_version=3, max_staleness=1, block_ms=300)
    assert [b.group.group_id for b in got] == ["group-0", "group-1", "group-3"]
    reader.give_back(got[1:])
    reader.ack([got[0].entry_id])
    again = reader.read(1, current_version=4, max_staleness=1, block_ms=300)
    assert [(b.group.group_id, b.staleness) for b in again] == [("group-1", 1)]  # re-checked at the new version
    reader.ack([b.entry_id for b in again])
    # At v5 the held group-3 (v3) is stale and dropped; group-2 (v4), never handed out, comes next.
    later = reader.read(2, current_version=5, max_staleness=1, block_ms=300)
    assert [(b.group.group_id, b.staleness) for b in later] == [("group-2", 1)]
    reader.ack([b.entry_id for b in later])
    s = assert_balanced(client)
    assert (s["buffer/acknowledged"], s["buffer/dropped_stale"], s["buffer/consumed"]) == (3, 1, 3)
    assert s["buffer/staleness/1"] == 3 and s["buffer/pending"] == 0


def test_a_reader_ending_between_steps_puts_back_what_it_did_not_train(client: redis.Redis) -> None:
    """A learner that finishes leaves nothing pending on it: the groups it read ahead and the ones it gave
    back go back to the stream undelivered, whole, and the next reader reads them like new ones."""
    c = cfg(claim_idle_ms=60_000)
    writer, reader = TrajectoryWriter(client, KEYS, c), TrajectoryReader(client, KEYS, c)
    for seed in range(4):
        writer.put(make_group(seed=seed))
    got = reader.read(2, current_version=2, max_staleness=1, block_ms=300)
    reader.ack([got[0].entry_id])
    reader.give_back(got[1:])
    assert buffer_stats(client, KEYS)["buffer/pending"] == 3  # one given back, two read ahead
    assert reader.release() == 3
    assert reader.release() == 0 and reader.unacknowledged() == 0
    s = assert_balanced(client)
    assert (s["buffer/pending"], s["buffer/depth"], s["buffer/consumed"], s["buffer/acknowledged"]) == (0, 3, 1, 1)
    nxt = TrajectoryReader(client, KEYS, c, consumer="learner-0")
    assert nxt.recover() == 0  # nothing of the first reader's is pending any more
    rest = nxt.read(3, current_version=2, max_staleness=1, block_ms=300)
    assert sorted(b.group.group_id for b in rest) == ["group-1", "group-2", "group-3"]
    for b in rest:  # whole: the same tokens as written
        sent = make_group(seed=int(b.group.group_id.removeprefix("group-")))
        np.testing.assert_array_equal(
            b.group.trajectories[0].completion_token_ids, sent.trajectories[0].completion_token_ids
        )
    nxt.ack([b.entry_id for b in rest])
    s = assert_balanced(client)
    assert (s["buffer/pending"], s["buffer/depth"], s["buffer/consumed"], s["buffer/acknowledged"]) == (0, 0, 4, 4)
    assert client.keys(KEYS.payload("*")) == []  # the payloads were kept for them, then freed with the acks
