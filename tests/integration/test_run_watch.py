"""Why a run trains nothing, said in one line: :class:`buffer.health.RunWatch` on a real Redis.

The counters and streams are written the way the rollout servers and the learner write them; the watch's
clock is passed in, so no test waits or measures time.
"""

from __future__ import annotations

import logging

import pytest
import redis

from buffer import RedisKeys, ServerInfo, ServerRegistry
from buffer.health import RunWatch, clear_run_end, publish_run_end, run_ended
from learner.feed import DataTimeout, Feed
from tether.config import TetherConfig
from tether.redis_server import connect_redis

RUN = "watch"


def _cfg(reward: dict | None = None) -> TetherConfig:
    return TetherConfig.model_validate(
        {"run": {"run_id": RUN}, "rollout": {"reward": reward or {"type": "demo"}}, "algorithm": {"max_staleness": 2}}
    )


def _register(client: redis.Redis) -> None:
    ServerRegistry(client, RedisKeys(RUN)).heartbeat(ServerInfo("rollout-0", address="127.0.0.1:1"), ttl_s=60)


def test_no_server_registered_is_said_after_the_grace_period_and_not_repeated(redis_client: redis.Redis) -> None:
    watch = RunWatch(_cfg(), no_server_after_s=30, repeat_s=60)
    assert watch.check(redis_client, now=0) == []
    assert watch.check(redis_client, now=29) == []
    [message] = watch.check(redis_client, now=31)
    assert "no rollout server registered" in message and "rollout.num_servers" in message
    assert "tether rollout" in message
    assert watch.check(redis_client, now=40) == []  # not every tick
    _register(redis_client)
    assert watch.check(redis_client, now=100) == []


def test_groups_dead_lettered_by_an_unreachable_reward_service_name_its_address(redis_client: redis.Redis) -> None:
    keys = RedisKeys(RUN)
    _register(redis_client)
    watch = RunWatch(_cfg({"type": "remote", "address": "127.0.0.1:9"}), window_s=10)
    assert watch.check(redis_client, now=0) == []
    for _ in range(3):  # what rollout_server.sink.dead_letter writes
        redis_client.xadd(keys.dead_letter, {"reason": "prompt-1: reward failed: reward service 127.0.0.1:9: "
                                             "UNAVAILABLE: failed to connect"})  # fmt: skip
        redis_client.hincrby(keys.counters, "rollout_dead_letter", 1)
    assert watch.check(redis_client, now=5) == []  # a window has not passed yet
    [message] = watch.check(redis_client, now=11)
    assert "3 groups dead-lettered and none trained" in message
    assert "127.0.0.1:9" in message and "rollout.reward.address" in message


def test_a_training_run_with_some_dead_letters_and_stale_drops_stays_quiet(redis_client: redis.Redis) -> None:
    keys = RedisKeys(RUN)
    _register(redis_client)
    watch = RunWatch(_cfg(), window_s=10)
    watch.check(redis_client, now=0)
    redis_client.hincrby(keys.counters, "dropped_stale", 5)
    redis_client.hincrby(keys.counters, "dead_letter", 1)
    redis_client.hincrby(keys.counters, "acknowledged", 8)
    assert watch.check(redis_client, now=11) == []


def test_all_groups_dropped_as_stale_names_max_staleness_and_weight_sync(redis_client: redis.Redis) -> None:
    keys = RedisKeys(RUN)
    _register(redis_client)
    redis_client.hincrby(keys.counters, "acknowledged", 8)  # it trained before, then stopped
    watch = RunWatch(_cfg(), window_s=10)
    watch.check(redis_client, now=0)
    redis_client.hincrby(keys.counters, "dropped_stale", 12)
    [message] = watch.check(redis_client, now=12)
    assert "12 groups dropped as stale" in message
    assert "algorithm.max_staleness (2)" in message and "weight_sync" in message


def test_a_learner_stuck_after_its_last_groups_were_stale_is_explained(redis_client: redis.Redis) -> None:
    """Episodes written long before the learner got to them: it trains a step, finds the rest stale in the same
    second, and then waits for groups nobody makes. The drops are all in the past; the warning must come."""
    keys = RedisKeys(RUN)
    _register(redis_client)
    watch = RunWatch(_cfg(), window_s=10)
    for t in range(3):  # training, a step a second
        redis_client.hincrby(keys.counters, "acknowledged", 2)
        assert watch.check(redis_client, now=t) == []
    redis_client.hincrby(keys.counters, "acknowledged", 2)
    redis_client.hincrby(keys.counters, "dropped_stale", 4)
    assert watch.check(redis_client, now=3) == []
    assert watch.check(redis_client, now=8) == []
    [message] = watch.check(redis_client, now=14)
    assert "4 groups dropped as stale and none trained" in message


def test_slow_steps_widen_the_window(redis_client: redis.Redis) -> None:
    keys = RedisKeys(RUN)
    _register(redis_client)
    watch = RunWatch(_cfg(), window_s=10)
    for t in (0, 30, 60):  # a big model: a step every 30 s
        redis_client.hincrby(keys.counters, "acknowledged", 2)
        watch.check(redis_client, now=t)
    redis_client.hincrby(keys.counters, "dropped_stale", 1)
    assert watch.check(redis_client, now=85) == []  # 25 s without a step is normal here
    assert watch.check(redis_client, now=151) != []  # 91 s (> 3 steps) is not


def test_run_end_is_published_and_cleared(redis_client: redis.Redis) -> None:
    keys = RedisKeys(RUN)
    assert run_ended(redis_client, keys) is None
    publish_run_end(redis_client, keys, step=60, version=60)
    assert run_ended(redis_client, keys)["step"] == 60
    clear_run_end(redis_client, keys)
    assert run_ended(redis_client, keys) is None


def test_a_learner_started_by_hand_says_why_it_waits(redis_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """No ``tether up`` console: the learner's feed logs the watch's words while no group comes."""
    cfg = TetherConfig.model_validate(
        {"run": {"run_id": RUN}, "buffer": {"redis_url": redis_url},
         "learner": {"data_path": "demo:charclass", "train_batch_size": 2, "read_timeout_s": 3}}
    )  # fmt: skip
    client = connect_redis(redis_url)
    feed = Feed(cfg, client, data_position=0)
    feed.watch = RunWatch(cfg, no_server_after_s=0)  # the real default waits 45 s for servers to load
    with caplog.at_level(logging.WARNING), pytest.raises(DataTimeout):
        feed.next_batch(0)
    client.close()
    said = [r.getMessage() for r in caplog.records if "not_training" in r.getMessage()]
    assert said and "no rollout server registered" in said[0]
