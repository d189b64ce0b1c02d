"""The books a checkpoint keeps, and putting them back into a Redis that lost the run (real Redis).

A run's state is built the way the processes build it — prompts fed under admission, some answered by
groups in the trajectories stream, some trained on and acknowledged — then snapshot, and restored into
an empty Redis, into one older than the checkpoint, and into one that kept the run.
"""

from __future__ import annotations

import itertools
import threading

import redis

from buffer import PromptQueue, RedisKeys, TrajectoryReader, TrajectoryWriter
from buffer.keys import PROMPT_GROUP
from buffer.ledger import begin_lifetime, restore, run_books, take_snapshot
from buffer.replies import int_hash
from tests.unit.test_buffer_codec import make_group
from tether.config.buffer import BufferConfig
from tether.v1.trajectory_pb2 import Prompt

B, STALENESS = 4, 1


def _prompts(start: int = 0):
    for i in itertools.count(start):
        yield Prompt(prompt_id=f"p{i}", dataset_index=i, text=f"prompt {i}")


def _build_run(client: redis.Redis, keys: RedisKeys) -> list[int]:
    """Two versions' worth of prompts issued; 6 answered (their groups written), 4 of those trained on.
    Returns the dataset indices left outstanding."""
    cfg = BufferConfig()
    queue = PromptQueue(client, keys)
    begin_lifetime(client, keys, step=0, version=0)
    assert queue.feed(_prompts(), version=0, prompts_per_version=B, max_staleness=STALENESS) == 2 * B
    taken = queue.read("rollout-0", count=6, block_ms=0)
    writer = TrajectoryWriter(client, keys, cfg)
    for eid, prompt in taken:
        group = make_group(version=0, seed=prompt.dataset_index)
        group.prompt_id = eid
        group.metadata = {"dataset_index": str(prompt.dataset_index)}
        writer.put(group)
    queue.ack([eid for eid, _ in taken])
    reader = TrajectoryReader(client, keys, cfg)
    trained = reader.read(4, current_version=0, max_staleness=STALENESS, block_ms=0)
    reader.ack([b.entry_id for b in trained])
    trained_indices = {int(b.group.metadata["dataset_index"]) for b in trained}
    return sorted(set(range(2 * B)) - trained_indices)


def test_snapshot_names_every_outstanding_prompt(redis_client: redis.Redis) -> None:
    keys = RedisKeys("ledger")
    outstanding = _build_run(redis_client, keys)
    snap = take_snapshot(redis_client, keys)
    assert snap.outstanding == outstanding and len(outstanding) == 4  # 2 waiting + 2 answered, not trained
    assert snap.in_stream == 2
    assert snap.counters["prompts_issued"] == 2 * B
    assert snap.counters["acknowledged"] == 4
    assert "bytes" not in snap.counters  # a gauge of the streams' contents is not history
    assert len(snap.lifetimes) == 1


def test_restore_into_an_empty_redis_puts_the_books_back(redis_client: redis.Redis) -> None:
    keys = RedisKeys("ledger")
    _build_run(redis_client, keys)
    snap = take_snapshot(redis_client, keys)
    redis_client.flushdb()  # the Redis came back without its data

    reissue = restore(redis_client, keys, snap)
    assert reissue == snap.outstanding
    queue = PromptQueue(redis_client, keys)
    assert queue.issued() == 2 * B  # the admission count survives: no burst of a whole bound
    assert queue.feed(_prompts(2 * B), version=0, prompts_per_version=B, max_staleness=STALENESS) == 0
    begin_lifetime(redis_client, keys, step=1, version=0)
    queue.reissue([Prompt(prompt_id=f"p{i}", dataset_index=i) for i in reissue], version=0)
    books = run_books(redis_client, keys)
    assert books["run"]["lost_in_restart"] == snap.in_stream == 2
    assert books["run"]["prompts_reissued"] == 4
    assert books["run"]["acknowledged"] == 4
    assert books["run"]["balanced"]  # produced 6 = acknowledged 4 + lost 2 + in stream 0
    assert [life["prompts_reissued"] for life in books["lifetimes"]] == [0, 4]
    assert snap.lengths and int_hash(redis_client.hgetall(keys.lengths)) == snap.lengths  # the length book too
    waiting = redis_client.xreadgroup(PROMPT_GROUP, "rollout-1", {keys.prompts: ">"}, count=100)
    assert sorted(Prompt.FromString(f[b"p"]).dataset_index for _, f in waiting[0][1]) == reissue


def test_restore_replaces_a_redis_older_than_the_checkpoint(redis_client: redis.Redis) -> None:
    keys = RedisKeys("ledger")
    _build_run(redis_client, keys)
    old_issued = 2 * B
    queue = PromptQueue(redis_client, keys)
    queue.feed(_prompts(old_issued), version=1, prompts_per_version=B, max_staleness=STALENESS)
    snap = take_snapshot(redis_client, keys)  # the checkpoint saw 3 versions' worth issued
    redis_client.hset(keys.counters, "prompts_issued", old_issued)  # a Redis restored from an older backup

    assert restore(redis_client, keys, snap) == snap.outstanding
    assert int(redis_client.hget(keys.counters, "prompts_issued")) == snap.counters["prompts_issued"]
    assert redis_client.xlen(keys.prompts) == 0  # the old streams are gone; the outstanding prompts get reissued


def test_restore_leaves_a_redis_that_kept_the_run_alone(redis_client: redis.Redis) -> None:
    keys = RedisKeys("ledger")
    _build_run(redis_client, keys)
    snap = take_snapshot(redis_client, keys)
    before = redis_client.hgetall(keys.counters)
    assert restore(redis_client, keys, snap) == []
    assert redis_client.hgetall(keys.counters) == before
    assert restore(redis_client, keys, None) == []


def test_snapshot_counters_and_stream_agree_while_groups_arrive(redis_client: redis.Redis, redis_url: str) -> None:
    """A checkpoint's snapshot is taken while rollout servers keep putting groups: its ``produced`` and its
    count of groups in the stream must be of the same moment, or a restore counts a group lost that was
    never produced (the run's books then never balance). A writer puts groups without pause while snapshots
    are taken; every snapshot must balance."""
    keys = RedisKeys("ledger-race")
    done = threading.Event()

    def produce() -> None:
        client = redis.Redis.from_url(redis_url)
        writer = TrajectoryWriter(client, keys, BufferConfig())
        try:
            for i in range(600):
                group = make_group(version=0, seed=i)
                group.group_id = f"race-{i}"
                for t in group.trajectories:
                    t.group_id = group.group_id
                writer.put(group)
        finally:
            done.set()
            client.close()

    thread = threading.Thread(target=produce)
    thread.start()
    snapshots = []
    try:
        while not done.is_set() and len(snapshots) < 2000:
            snapshots.append(take_snapshot(redis_client, keys))
    finally:
        thread.join(timeout=60)
    assert len(snapshots) > 10
    off = [
        (s.counters.get("produced", 0), s.in_stream) for s in snapshots if s.counters.get("produced", 0) != s.in_stream
    ]
    assert not off, f"{len(off)} of {len(snapshots)} snapshots: (produced, in stream) {off[:5]}"
