"""Where the buffer meets its callers, against a real Redis: a rollout server's dead letters go through
``buffer.dead_letter`` (stream entry, counter, admission slot given back), and the reader's staleness of a
group is what the learner's sample builder computes for it."""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest
import redis

from buffer import PromptQueue, RedisKeys, TrajectoryReader, TrajectoryWriter, buffer_stats, dead_letter
from buffer.dead_letter import ROLLOUT_DEAD_LETTER
from learner.batch import build_samples
from tests.unit.test_buffer_policy import random_group
from tether.config import load_config
from tether.config.buffer import BufferConfig
from tether.trajectory import InvalidTrajectory
from tether.v1.trajectory_pb2 import Prompt


def test_dead_letter_writes_the_record_and_counts_it(redis_client: redis.Redis) -> None:
    keys = RedisKeys("dl")
    eid = dead_letter(redis_client, keys, source="rollout:r0", reason="x" * 900, data=b"\x00\xffpayload")
    ((got_id, fields),) = redis_client.xrange(keys.dead_letter)
    assert got_id.decode() == eid
    assert fields[b"source"] == b"rollout:r0" and fields[b"data"] == b"\x00\xffpayload"
    assert len(fields[b"reason"]) == 500  # capped, not refused
    assert int(redis_client.hget(keys.counters, ROLLOUT_DEAD_LETTER)) == 1
    assert buffer_stats(redis_client, keys)["buffer/dead_letter_depth"] == 1


async def test_sink_dead_letter_gives_the_admission_slot_back(redis_url: str) -> None:
    from rollout_server.sink import BufferSink

    run_id = f"dls-{uuid.uuid4().hex[:6]}"
    cfg = load_config(None, ["--run.run_id", run_id, "--buffer.redis_url", redis_url])
    client = redis.Redis.from_url(redis_url)
    keys = RedisKeys(run_id)
    feed = PromptQueue(client, keys)
    prompts = iter([Prompt(text=f"p{i}") for i in range(3)])
    sink = BufferSink(cfg, "r0")
    try:
        assert feed.feed(prompts, version=0, prompts_per_version=1, max_staleness=0) == 1
        assert feed.feed(prompts, version=0, prompts_per_version=1, max_staleness=0) == 0  # its group is owed
        await asyncio.wait_for(sink.dead_letter(reason="prompt-1: reward failed", data=b"group"), 10)
        ((_, fields),) = client.xrange(keys.dead_letter)
        assert fields[b"source"] == b"rollout:r0" and fields[b"reason"] == b"prompt-1: reward failed"
        assert feed.feed(prompts, version=0, prompts_per_version=1, max_staleness=0) == 1  # the slot came back
    finally:
        sink.close()
        client.close()


async def test_sink_sends_groups_that_finish_together_in_one_round_trip(redis_url: str) -> None:
    from rollout_server.sink import BufferSink

    run_id = f"batch-{uuid.uuid4().hex[:6]}"
    cfg = load_config(None, ["--run.run_id", run_id, "--buffer.redis_url", redis_url])
    client, keys = redis.Redis.from_url(redis_url), RedisKeys(run_id)
    rng = np.random.default_rng(0)
    sink = BufferSink(cfg, "r0")
    try:
        known = random_group(rng, 0)
        assert await asyncio.wait_for(sink.put(known), 10)
        groups = [random_group(rng, k) for k in range(1, 8)] + [known]  # the last one: a retried prompt
        execs = client.info("commandstats")["cmdstat_exec"]["calls"]
        fresh = await asyncio.wait_for(asyncio.gather(*map(sink.put, groups)), 10)
        assert fresh == [True] * 7 + [False]
        assert client.info("commandstats")["cmdstat_exec"]["calls"] - execs <= 2  # not one per group
        assert client.xlen(keys.trajectories) == 8
        # A malformed group among good ones: its caller gets the error, the others are written.
        bad = random_group(rng, 9)
        bad.trajectories[0].policy_versions = bad.trajectories[0].policy_versions[:-1]
        good = [random_group(rng, k) for k in (10, 11)]
        out = await asyncio.wait_for(
            asyncio.gather(*map(sink.put, [good[0], bad, good[1]]), return_exceptions=True), 10
        )
        assert out[0] is True and out[2] is True and isinstance(out[1], InvalidTrajectory)
        assert client.xlen(keys.trajectories) == 10
        assert buffer_stats(client, keys)["buffer/produced"] == 10
    finally:
        sink.close()
        client.close()


async def test_sink_tells_callers_which_groups_a_full_batch_took(redis_url: str) -> None:
    # Three groups finish together into a buffer with room for two: the two it took are fresh inserts
    # (not "duplicates" from a retry of the whole batch), the third caller gets BufferFull.
    from buffer import BufferFull
    from rollout_server.sink import BufferSink

    run_id = f"full-{uuid.uuid4().hex[:6]}"
    cfg = load_config(None, ["--run.run_id", run_id, "--buffer.redis_url", redis_url,
                             "--buffer.max_trajectory_groups", "2", "--buffer.put_timeout_s", "0.2"])  # fmt: skip
    client, keys = redis.Redis.from_url(redis_url), RedisKeys(run_id)
    rng = np.random.default_rng(1)
    sink = BufferSink(cfg, "r0")
    try:
        groups = [random_group(rng, k) for k in range(3)]
        out = await asyncio.wait_for(asyncio.gather(*map(sink.put, groups), return_exceptions=True), 10)
        assert out[:2] == [True, True] and isinstance(out[2], BufferFull), out
        assert client.xlen(keys.trajectories) == 2
        stats = buffer_stats(client, keys)
        assert stats["buffer/produced"] == 2 and stats.get("buffer/duplicates", 0) == 0, stats
    finally:
        sink.close()
        client.close()


@pytest.mark.parametrize("seed", range(3))
def test_reader_and_learner_agree_on_staleness(redis_client: redis.Redis, seed: int) -> None:
    rng = np.random.default_rng(seed)
    keys, cfg = RedisKeys(f"st{seed}"), BufferConfig()
    writer, reader = TrajectoryWriter(redis_client, keys, cfg), TrajectoryReader(redis_client, keys, cfg)
    groups = [random_group(rng, k) for k in range(8)]
    for g in groups:
        writer.put(g)
    current = int(rng.integers(0, 10))
    got = reader.read(len(groups), current_version=current, max_staleness=100, block_ms=1000)
    assert [b.group.group_id for b in got] == [g.group_id for g in groups]
    for b in got:
        samples, _ = build_samples([b.group], current_version=current)
        assert max(s.staleness for s in samples) == b.staleness
    reader.ack([b.entry_id for b in got])


async def test_sink_heartbeat_is_not_queued_behind_the_data_path(redis_url: str) -> None:
    # Every thread of the data path's pool busy (as blocking prompt reads and inserts waiting for room
    # make it): the server's heartbeat still lands, so the learner keeps counting the server as live.
    import threading

    from buffer import ServerRegistry
    from rollout_server.sink import BufferSink

    run_id = f"beat-{uuid.uuid4().hex[:6]}"
    cfg = load_config(None, ["--run.run_id", run_id, "--buffer.redis_url", redis_url])
    client, keys = redis.Redis.from_url(redis_url), RedisKeys(run_id)
    sink, release = BufferSink(cfg, "r0"), threading.Event()
    try:
        busy = [sink._pool.submit(release.wait, 30) for _ in range(sink._pool._max_workers)]
        await asyncio.wait_for(sink.heartbeat(address="a:1", engine="e", policy_version=3, extra={}), 10)
        assert [s.server_id for s in ServerRegistry(client, keys).live()] == ["r0"]
        assert not any(f.done() for f in busy)  # the data path was saturated throughout
    finally:
        release.set()
        sink.close()
        client.close()
