"""A step waits for the groups that would be too old for the next step, and trains them before newer ones.

On a real Redis with the learner's own feed, the prompts stream and the trajectories stream, and a stand-in
rollout server (the buffer's own server-side calls) that finishes the first version's last two prompts
late — the long completions. With ``stale_wait_s`` the step at version 1 trains exactly those two (the
newer groups that arrived first wait one step); with ``stale_wait_s: 0`` it trains the newer ones and the
late pair is dropped as stale at version 2: the length bias docs/STALENESS.md describes. The run's last
step does not wait (no later step would train what it waited for), and what it read and did not train goes
back to the stream when the feed ends.
"""

from __future__ import annotations

import threading
import time

import pytest

from buffer import PromptQueue, RedisKeys, TrajectoryWriter, buffer_stats
from learner.feed import Feed
from tests.unit.test_buffer_codec import make_group
from tether.config import TetherConfig
from tether.redis_server import connect_redis
from tether.trajectory import PROMPT_GROUP_PREFIX

B, STALENESS = 2, 1


def _group(entry_id: str, *, version: int, tokens: int):
    g = make_group(seed=hash(entry_id) % 1000, tokens=tokens, version=version)
    g.group_id = PROMPT_GROUP_PREFIX + entry_id
    for t in g.trajectories:
        t.group_id = g.group_id
        t.policy_versions[:] = version
    return g


@pytest.mark.parametrize(
    ("wait_s", "last"), [(30.0, False), (0.0, False), (30.0, True)], ids=["wait", "no-wait", "last"]
)
def test_the_late_groups_of_an_old_version_are_trained_before_they_expire(
    redis_url: str, wait_s: float, last: bool
) -> None:
    cfg = TetherConfig.model_validate(
        {"run": {"run_id": "stalewait"}, "buffer": {"redis_url": redis_url},
         "learner": {"data_path": "demo:charclass", "train_batch_size": B},
         "algorithm": {"max_staleness": STALENESS, "stale_wait_s": wait_s}}
    )  # fmt: skip
    client = connect_redis(redis_url)
    keys = RedisKeys("stalewait")
    feed = Feed(cfg, client, data_position=0)
    server, writer = PromptQueue(client, keys), TrajectoryWriter(client, keys, cfg.buffer)

    def finish(entry_id: str, *, version: int, tokens: int = 8) -> None:
        writer.put(_group(entry_id, version=version, tokens=tokens))
        server.ack([entry_id])

    assert feed.feed(0) == (STALENESS + 1) * B
    first = [eid for eid, _ in server.read("rollout-0", count=4, block_ms=100)]  # all four taken at version 0
    for eid in first[:2]:
        finish(eid, version=0)
    step0 = feed.next_batch(0)  # nothing is due yet
    assert sorted(b.group.group_id for b in step0) == sorted(PROMPT_GROUP_PREFIX + e for e in first[:2])
    feed.ack(step0)

    assert feed.feed(1) == B
    newer = [eid for eid, _ in server.read("rollout-0", count=2, block_ms=100)]
    for eid in newer:  # short: done before the long pair of version 0
        finish(eid, version=1)
    late = threading.Thread(target=lambda: [time.sleep(0.5), *(finish(e, version=0, tokens=200) for e in first[2:])])
    late.start()
    step1 = feed.next_batch(1, last=last)
    late.join()
    trained = {b.group.group_id for b in step1}
    assert (feed.stale_wait_s > 0) == (bool(wait_s) and not last)  # logged as timing/wait_stale
    if last:
        assert trained == {PROMPT_GROUP_PREFIX + e for e in newer}
        feed.ack(step1)
        # one of the late pair handed out and given back, the other read ahead: both pending on the learner
        feed.reader.give_back(feed.reader.read(1, current_version=1, max_staleness=STALENESS, block_ms=500))
        assert buffer_stats(client, keys)["buffer/pending"] == 2
        feed.release()
        s = buffer_stats(client, keys)
        # nothing left pending on the learner; the late pair waits, undelivered, for a resumed run
        assert (s["buffer/pending"], s["buffer/depth"], s["buffer/acknowledged"]) == (0, 2, 4)
        client.close()
        return
    if wait_s:
        assert trained == {PROMPT_GROUP_PREFIX + e for e in first[2:]}  # the long ones, before they expire
        feed.ack(step1)
        step2 = feed.next_batch(2)  # the newer pair was given back, and is handed out now
        assert {b.group.group_id for b in step2} == {PROMPT_GROUP_PREFIX + e for e in newer}
        assert [b.staleness for b in step2] == [1, 1]
        feed.ack(step2)
    else:
        assert trained == {PROMPT_GROUP_PREFIX + e for e in newer}
        feed.ack(step1)
        assert feed.reader.read(B, current_version=2, max_staleness=STALENESS, block_ms=500) == []
    s = buffer_stats(client, keys)
    assert s["buffer/produced"] == 6 and s["buffer/depth"] == 0
    assert (s["buffer/acknowledged"], s["buffer/dropped_stale"]) == ((6, 0) if wait_s else (4, 2))
    assert s["buffer/length_drop_rate/182-255"] == (0.0 if wait_s else 1.0)
    client.close()
