"""Separate fleets on separate hosts, under network faults. Each scenario: the run reaches its steps, the
books balance, and no acknowledged group is lost (acknowledged = steps × batch)."""

from __future__ import annotations

import signal
import time

import pytest

from tests.cluster.cluster import BATCH, HOSTS

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]
STEPS_JOIN = 300  # the tiny model steps in ~0.15 s: long enough for a server started mid-run to load and serve


def _assert_run_whole(cluster, steps: int) -> None:
    rows = cluster.steps_done()
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    books = cluster.books()
    assert books["balanced"], books
    assert books["acknowledged"] == steps * BATCH, books


def test_steady_run_across_hosts(make_cluster) -> None:
    cluster = make_cluster(steps=6).start()
    cluster.wait_finished()
    _assert_run_whole(cluster, 6)
    rows = cluster.steps_done()
    assert rows[-1]["weight_sync/reached"] == 2  # both rollout hosts got the last update over gloo
    assert rows[-1]["data/version_max"] >= 1  # trained on data of a policy the learner pushed


def test_delay_and_loss_on_every_link(make_cluster) -> None:
    cluster = make_cluster(steps=4)
    cluster.lab.set_link("*", "*", both=False, delay_ms=25, jitter_ms=5, loss=0.01)  # 50 ± 10 ms round trip
    cluster.start()
    cluster.wait_finished()
    _assert_run_whole(cluster, 4)
    assert cluster.lab.switch_stats()["dropped_loss"] > 0  # the loss was real


def test_rollout_host_cut_off_then_healed(make_cluster) -> None:
    cluster = make_cluster(steps=14).start()
    cluster.wait_for_step(3)
    cluster.lab.isolate("rollout1")  # longer than every weight-sync deadline (5 + 15 + 10 s)
    cut_at = time.monotonic()
    cluster.wait_for_step(6)  # the learner goes on with rollout0 alone
    time.sleep(max(0.0, 20 - (time.monotonic() - cut_at)))
    cluster.lab.isolate("rollout1", cut=False)
    healed_at = time.monotonic()
    caught_up = None
    while time.monotonic() - healed_at < 120:
        reg = cluster.registry()
        if reg["servers"].get("rollout1", -1) >= reg["version"] - 1 and "rollout1" in reg["servers"]:
            caught_up = time.monotonic() - healed_at
            break
        time.sleep(1)
    assert caught_up is not None, cluster.logs()
    cluster.wait_finished()
    _assert_run_whole(cluster, 14)
    rows = cluster.steps_done()
    wcfg_deadlines = 5 + 15 + 10
    assert max(r.get("timing/weight_sync", 0) for r in rows) < wcfg_deadlines + 5  # never blocked past them


def test_learner_cut_off_from_redis_then_healed(make_cluster) -> None:
    cluster = make_cluster(steps=8).start()
    cluster.wait_for_step(2)
    cluster.lab.set_link("learner0", "redis", cut=True)
    time.sleep(10)
    cluster.lab.set_link("learner0", "redis")
    cluster.wait_finished()
    _assert_run_whole(cluster, 8)


def test_a_third_rollout_host_joins_mid_run(make_cluster) -> None:
    # Two prompts at a time per server: the look-ahead of 8 prompts needs every server, the new one included.
    cluster = make_cluster(steps=STEPS_JOIN, rollout={"prompt_workers": 2}).start()
    cluster.wait_for_step(3)
    cluster.start_rollout("rollout2")
    joined = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # registered, and at the current version (snapshot, then the updates)
        reg = cluster.registry()
        if reg["servers"].get("rollout2", -2) >= reg["version"] - 1:
            joined = reg
            break
        time.sleep(0.5)
    assert joined is not None, cluster.logs()
    deadline = time.monotonic() + 120
    while cluster.groups_written("rollout2") == 0:  # and it receives work
        assert time.monotonic() < deadline and cluster.learners[0].poll() is None, cluster.logs()
        time.sleep(0.5)
    cluster.wait_finished()
    _assert_run_whole(cluster, STEPS_JOIN)


def test_redis_killed_and_restarted_from_its_aof(make_cluster) -> None:
    cluster = make_cluster(steps=10).start()
    cluster.wait_for_step(3)
    cluster.lab.stop(cluster.redis, sig=signal.SIGKILL)
    time.sleep(3)
    cluster.start_redis()
    cluster.wait_finished()
    _assert_run_whole(cluster, 10)
    assert HOSTS["redis"] in cluster.redis_url
