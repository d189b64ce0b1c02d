"""Why a run trains nothing, said in one line: :class:`buffer.health.RunWatch` on a real Redis; and when it
cannot train at all, :class:`buffer.health.StallWatch` ends it with the most common reason.

The counters and streams are written the way the rollout servers and the learner write them; the watch's
clock is passed in, so no test waits or measures time.
"""

from __future__ import annotations

import logging

import pytest
import redis

from buffer import RedisKeys, ServerInfo, ServerRegistry
from buffer.health import RunWatch, StallWatch, clear_run_end, publish_run_end, run_ended
from learner.feed import CannotTrain, DataTimeout, Feed
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


def _dead_letter(client: redis.Redis, reason: str, n: int = 1) -> None:
    from buffer.dead_letter import dead_letter

    for i in range(n):  # as rollout_server.worker writes them: the group id, then the reason
        dead_letter(client, RedisKeys(RUN), source="rollout-0", reason=f"prompt-17123456{i}-0: {reason}", data=b"")


TOO_LONG = "bad prompt: prompt: {} tokens is longer than the limit of 64 (rollout.max_prompt_len)"


def test_a_run_whose_every_group_is_dead_lettered_cannot_train_and_says_the_most_common_reason(
    redis_client: redis.Redis,
) -> None:
    cfg = _cfg()
    stall = StallWatch(cfg, timeout_s=30, min_groups=8)
    _dead_letter(redis_client, "reward failed: old", n=5)  # before the learner waited: not counted
    assert stall.check(redis_client, now=0) is None
    for t in range(2, 40, 2):  # the GSM8K case: every prompt too long for the servers, a few a second
        _dead_letter(redis_client, TOO_LONG.format(150 + t), n=3)
        verdict = stall.check(redis_client, now=t)
        if t < 32:  # the clock started at the first wasted group (t=2), not at the first check
            assert verdict is None, t
    _dead_letter(redis_client, "reward failed: reward service 127.0.0.1:9: UNAVAILABLE", n=4)  # a few others
    verdict = stall.check(redis_client, now=40)
    assert verdict is not None and verdict.startswith("the run cannot train: 61 groups wasted and none trained")
    assert "most common reason (57 of 61)" in verdict and "tokens is longer than the limit of 64" in verdict
    assert "check rollout.max_prompt_len" in verdict and "learner.stuck_timeout_s" in verdict


def test_stale_groups_only_end_a_run_while_they_keep_coming(redis_client: redis.Redis) -> None:
    keys = RedisKeys(RUN)
    stall = StallWatch(_cfg(), timeout_s=30, min_groups=4)
    stall.check(redis_client, now=0)
    redis_client.hincrby(keys.counters, "dropped_stale", 20)  # a restart's burst of old groups ...
    assert stall.check(redis_client, now=2) is None
    for t in range(4, 70, 2):  # ... then fresh groups take long (a big model): not a stall
        assert stall.check(redis_client, now=t) is None, t
    for t in range(70, 100, 2):  # weight updates that never reach the servers: stale groups keep coming
        redis_client.hincrby(keys.counters, "dropped_stale", 1)
        verdict = stall.check(redis_client, now=t)
    assert verdict is not None and "dropped as stale" in verdict and "algorithm.max_staleness (2)" in verdict


def test_a_slow_healthy_run_never_stalls(redis_client: redis.Redis) -> None:
    """Groups that can be trained keep arriving (a slow step, a slow model), or too few were wasted to be
    a pattern, or the check is off: never a verdict."""
    keys = RedisKeys(RUN)
    stall = StallWatch(_cfg(), timeout_s=30, min_groups=8)
    stall.check(redis_client, now=0)
    for t in range(0, 300, 10):  # a dead letter every 10 s, and a usable group every 20 s
        _dead_letter(redis_client, TOO_LONG.format(100))
        if t % 20 == 0:
            stall.usable()
        assert stall.check(redis_client, now=t) is None, t
    slow = StallWatch(_cfg(), timeout_s=30, min_groups=8)
    slow.check(redis_client, now=0)
    for t in range(5, 300, 5):  # one bad prompt a minute while the others generate for minutes
        if t % 60 == 0:
            _dead_letter(redis_client, TOO_LONG.format(100))
        assert slow.check(redis_client, now=t) is None, t
    off = StallWatch(_cfg(), timeout_s=0, min_groups=1)
    redis_client.hincrby(keys.counters, "dropped_stale", 100)
    assert all(off.check(redis_client, now=t) is None for t in range(0, 300, 10))


def test_a_learner_started_by_hand_ends_a_run_that_cannot_train(redis_url: str) -> None:
    """The feed raises :class:`CannotTrain` with the reason once every group of ``stuck_timeout_s`` was wasted."""
    import threading

    cfg = TetherConfig.model_validate(
        {"run": {"run_id": RUN}, "buffer": {"redis_url": redis_url},
         "learner": {"data_path": "demo:charclass", "train_batch_size": 2, "stuck_timeout_s": 3}}
    )  # fmt: skip
    client = connect_redis(redis_url)
    feed = Feed(cfg, client, data_position=0)
    stop = threading.Event()

    def server() -> None:  # every prompt refused as too long, as a rollout server dead-letters it
        writer = connect_redis(redis_url)
        while not stop.wait(0.2):
            _dead_letter(writer, TOO_LONG.format(155))
        writer.close()

    thread = threading.Thread(target=server)
    thread.start()
    try:
        with pytest.raises(CannotTrain, match=r"most common reason .* longer than the limit of 64.*max_prompt_len"):
            feed.next_batch(0)
    finally:
        stop.set()
        thread.join()
        client.close()
