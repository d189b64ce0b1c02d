"""The learner's status hash is written at most once per interval, and its last state at close.

``tether status`` samples ``tether:{run}:learner`` every second or two; a write per step put a Redis round
trip on the learner's critical path for nothing. Counted on a real Redis (its own command statistics).
"""

from __future__ import annotations

import redis


def _hset_calls(client: redis.Redis) -> int:
    return int(client.info("commandstats").get("cmdstat_hset", {}).get("calls", 0))


def test_status_hash_is_throttled_and_complete_at_close(redis_client: redis.Redis) -> None:
    from learner.telemetry import LiveStatus

    status = LiveStatus(client=redis_client, key="tether:t:learner", total_steps=30, start_step=0,
                        hash_interval_s=3600.0)  # fmt: skip
    before = _hset_calls(redis_client)
    for step in range(1, 21):
        status.update(step, version=step, metrics={"reward/mean": step / 100, "loss/total": 0.5})
    assert _hset_calls(redis_client) - before == 1  # the first step only: a person sees the run has started
    assert redis_client.hget("tether:t:learner", "step") == b"1"
    status.close()
    assert _hset_calls(redis_client) - before == 2
    row = redis_client.hgetall("tether:t:learner")
    assert row[b"step"] == b"20" and row[b"version"] == b"20" and float(row[b"reward_mean"]) == 0.2


def test_status_hash_every_step_with_a_zero_interval(redis_client: redis.Redis) -> None:
    from learner.telemetry import LiveStatus

    status = LiveStatus(client=redis_client, key="tether:t:learner", total_steps=5, start_step=0,
                        hash_interval_s=0.0)  # fmt: skip
    before = _hset_calls(redis_client)
    for step in range(1, 6):
        status.update(step, version=0, metrics={})
    status.close()  # nothing new to write
    assert _hset_calls(redis_client) - before == 5
    assert redis_client.hget("tether:t:learner", "step") == b"5"
