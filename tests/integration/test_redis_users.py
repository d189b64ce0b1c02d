"""Per-run Redis users (issue 36: a run cannot read or write another run's streams or weights), real Redis.

- A whole short run — ``tether learner`` and one ``tether rollout`` started by hand, both given the URL
  ``tether redis-user`` printed — trains to its last step and acknowledges every group, its weights
  published through files or through the weight store (whose keys are in Redis): the rules grant all a
  run's processes use.
- Run a's user reaches run a's keys (the buffer's scripts included) and not run b's: reading or writing b's
  trajectories, prompts and weights, or deleting b's keys, is refused, on Redis 6.2 and 7.
- Run a's user cannot run ACL, CONFIG, FLUSHALL nor flush the script cache every run shares.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from buffer import RedisKeys, TrajectoryReader, TrajectoryWriter
from buffer.acl import create_run_user, run_user
from tests.integration.test_up import REPO, write_config
from tests.unit.test_buffer_codec import make_group
from tether.config.buffer import BufferConfig
from tether.metrics import read_metrics

pytestmark = pytest.mark.slow
STEPS = 3


def _url_as(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    return parts._replace(netloc=f"{user}:{password}@{parts.netloc.rpartition('@')[2]}").geturl()


@pytest.fixture
def run_a(versioned_redis_url: str) -> Iterator[tuple[redis.Redis, redis.Redis]]:
    """(the admin's client, run ``ru-a``'s user's client) on Redis 6.2, then on 7."""
    admin = redis.Redis.from_url(versioned_redis_url)
    create_run_user(admin, "ru-a", "pw-a")
    user = redis.Redis.from_url(_url_as(versioned_redis_url, run_user("ru-a"), "pw-a"))
    yield admin, user
    user.close()
    admin.execute_command("ACL", "DELUSER", run_user("ru-a"))
    admin.close()


@pytest.mark.parametrize("transport", ["filesystem", "store"])
def test_a_short_run_trains_to_its_last_step_under_its_own_user(
    tmp_path: Path, tiny_model_dir: Path, redis_url: str, transport: str
) -> None:
    run_id = f"ru-{transport}"
    printed = subprocess.run([sys.executable, "-m", "tether", "redis-user", "--run", run_id, "--redis-url", redis_url],
                             cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert printed.returncode == 0, printed.stderr
    url = printed.stdout.strip()
    assert urlsplit(url).username == run_user(run_id) and urlsplit(url).password
    cfg = write_config(tmp_path, tiny_model_dir, run_id=run_id, steps=STEPS, transport=transport)
    common = ["--config", str(cfg), "--buffer.redis_url", url]
    server = subprocess.Popen([sys.executable, "-m", "tether", "rollout", *common, "--exit-when-run-ends"], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    learner = subprocess.Popen([sys.executable, "-m", "tether", "learner", *common], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        learner_out, _ = learner.communicate(timeout=420)
        assert learner.returncode == 0, learner_out[-3000:]
        server_out, _ = server.communicate(timeout=120)
        assert server.returncode == 0, server_out[-3000:]
    finally:
        for proc in (server, learner):
            if proc.poll() is None:
                proc.kill()
        admin = redis.Redis.from_url(redis_url)
        admin.execute_command("ACL", "DELUSER", run_user(run_id))
        admin.close()
    assert "NOPERM" not in learner_out + server_out and "no permissions" not in learner_out + server_out
    run_dir = tmp_path / "runs" / run_id
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("reward/mean") is not None]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    stats = json.loads((run_dir / "buffer_stats.json").read_text())
    assert stats["buffer/acknowledged"] == STEPS * 4 and stats["buffer/dead_letter"] == 0, stats


def test_a_runs_user_reaches_its_keys_and_not_another_runs(run_a: tuple[redis.Redis, redis.Redis]) -> None:
    admin, user = run_a
    a, b = RedisKeys("ru-a"), RedisKeys("ru-b")
    admin.xadd(b.trajectories, {"g": "b0"})
    admin.set(b.weights, "b-weights")
    refused = [
        lambda: user.xadd(b.trajectories, {"g": "x"}),
        lambda: user.xread({b.trajectories: "0"}),
        lambda: user.xrange(b.trajectories),
        lambda: user.get(b.weights),
        lambda: user.set(b.weights, "forged"),
        lambda: user.xadd(b.prompts, {"p": "x"}),
        lambda: user.delete(b.trajectories),
        lambda: user.delete(b.weights, a.weights),  # one key outside is enough
        lambda: user.get(b.run_config),
        lambda: user.get("tether:fleet:f1"),
        lambda: user.eval("return redis.call('GET', KEYS[1])", 1, b.weights),
    ]
    for op in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            op()
    # a script may not reach past its declared keys either: Redis checks each call against the user
    with pytest.raises(redis.ResponseError, match="can't access"):
        user.eval(f"return redis.call('GET', '{b.weights}')", 0)
    assert admin.get(b.weights) == b"b-weights" and admin.xlen(b.trajectories) == 1 and not admin.exists(b.prompts)

    # the same operations on its own run's keys, and the buffer itself (its Lua scripts) under the user
    user.xadd(a.prompts, {"p": "x"})
    user.set(a.weights, "a-weights")
    assert user.get(a.weights) == b"a-weights" and user.delete(a.weights, a.prompts) == 2
    user.sadd("tether:runs", "ru-a")
    cfg = BufferConfig(claim_idle_ms=200, put_timeout_s=0.3)
    writer, reader = TrajectoryWriter(user, a, cfg), TrajectoryReader(user, a, cfg)
    ids = [writer.put(make_group(seed=i)) for i in range(2)]
    assert user.xread({a.trajectories: "0"}) and user.xlen(a.trajectories) == 2
    got = reader.read(2, current_version=2, max_staleness=1, block_ms=300)
    assert [g.entry_id for g in got] == ids
    reader.ack(ids)
    assert user.xlen(a.trajectories) == 0


def test_a_runs_user_cannot_administer_the_server(run_a: tuple[redis.Redis, redis.Redis]) -> None:
    admin, user = run_a
    admin.set("tether:ru-b:version", "3")
    for command in (
        ("ACL", "SETUSER", run_user("ru-a"), "allkeys"),
        ("ACL", "LIST"),
        ("CONFIG", "GET", "requirepass"),
        ("FLUSHALL",),
        ("FLUSHDB",),
        ("KEYS", "*"),
        ("SCRIPT", "FLUSH"),
        ("CLIENT", "KILL", "TYPE", "normal"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command(*command)
    assert admin.get("tether:ru-b:version") == b"3"
