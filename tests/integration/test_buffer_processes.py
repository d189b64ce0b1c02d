"""The buffer across real processes: a learner SIGKILLed between read and ack, and several producers
and consumers at once (subprocesses talking only through Redis, as in a run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from buffer import RedisKeys, TrajectoryReader, TrajectoryWriter, buffer_stats
from tests.unit.test_buffer_codec import make_group
from tether.config.buffer import BufferConfig

ROOT = Path(__file__).resolve().parents[2]
KEYS = RedisKeys("p")

_READ_THEN_HANG = """
import sys, time, redis
from buffer import RedisKeys, TrajectoryReader
from tether.config.buffer import BufferConfig
reader = TrajectoryReader(redis.Redis.from_url(sys.argv[1]), RedisKeys("p"), BufferConfig(), consumer=sys.argv[2])
got = reader.read(1, current_version=2, max_staleness=1, block_ms=10000)
print(got[0].group.group_id, flush=True)
time.sleep(600)  # "training": killed before it acknowledges
"""

_PRODUCER = """
import sys, redis
from buffer import RedisKeys, TrajectoryWriter
from tests.unit.test_buffer_codec import make_group
from tether.config.buffer import BufferConfig
w = TrajectoryWriter(redis.Redis.from_url(sys.argv[1]), RedisKeys("p"),
                     BufferConfig(max_trajectory_groups=8, put_timeout_s=60))
start, n = int(sys.argv[2]), int(sys.argv[3])
for i in range(start, start + n):
    w.put(make_group(seed=i, tokens=64))
    w.put(make_group(seed=i, tokens=64))  # every insert retried once: must stay one entry
"""

_CONSUMER = """
import sys, redis
from buffer import RedisKeys, TrajectoryReader
from tether.config.buffer import BufferConfig
r = TrajectoryReader(redis.Redis.from_url(sys.argv[1]), RedisKeys("p"), BufferConfig(), consumer=sys.argv[2])
idle = 0
while idle < 3:
    got = r.read(4, current_version=2, max_staleness=1, block_ms=1000)
    idle = 0 if got else idle + 1
    for b in got:
        print(b.group.group_id, flush=True)
    r.ack([b.entry_id for b in got])
"""


def _spawn(script: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


@pytest.fixture
def client(versioned_redis_url: str):
    c = redis.Redis.from_url(versioned_redis_url)
    yield c
    c.close()


@pytest.mark.parametrize("same_consumer", [True, False], ids=["restart-recover", "other-consumer-claims"])
def test_consumer_killed_between_read_and_ack(
    client: redis.Redis, versioned_redis_url: str, same_consumer: bool
) -> None:
    cfg = BufferConfig(claim_idle_ms=300)
    TrajectoryWriter(client, KEYS, cfg).put(make_group(seed=5))
    proc = _spawn(_READ_THEN_HANG, versioned_redis_url, "learner-0")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "group-5"  # it holds the entry now
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    assert buffer_stats(client, KEYS)["buffer/pending"] == 1
    reader = TrajectoryReader(client, KEYS, cfg, consumer="learner-0" if same_consumer else "learner-1")
    got: list = []
    deadline = time.monotonic() + 15
    if same_consumer:
        assert reader.recover() == 1  # its own unacknowledged entry, at once
    while not got and time.monotonic() < deadline:  # another consumer: after claim_idle_ms
        got = reader.read(1, current_version=2, max_staleness=1, block_ms=200)
    assert [b.group.group_id for b in got] == ["group-5"]
    reader.ack([got[0].entry_id])
    s = buffer_stats(client, KEYS)
    assert (s["buffer/acknowledged"], s["buffer/pending"], s["buffer/depth"]) == (1, 0, 0)


@pytest.mark.slow
def test_several_producers_and_consumers(client: redis.Redis, versioned_redis_url: str) -> None:
    producers = [_spawn(_PRODUCER, versioned_redis_url, str(i * 15), "15") for i in range(3)]
    consumers = [_spawn(_CONSUMER, versioned_redis_url, f"learner-{i}") for i in range(2)]
    for p in producers:
        assert p.wait(timeout=120) == 0
    seen: list[str] = []
    for c in consumers:
        out, _ = c.communicate(timeout=120)
        assert c.returncode == 0
        seen += out.split()
    assert sorted(seen) == sorted(f"group-{i}" for i in range(45))  # each group exactly once, none lost
    s = buffer_stats(client, KEYS)
    assert (s["buffer/produced"], s["buffer/duplicates"], s["buffer/acknowledged"]) == (45, 45, 45)
    assert (s["buffer/depth"], s["buffer/bytes"], s["buffer/pending"]) == (0, 0, 0)
