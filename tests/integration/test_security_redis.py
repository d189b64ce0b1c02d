"""The buffer against a password-protected Redis, through an ACL user named in the URL.

A Redis with ``requirepass`` (the admin) and an ACL user ``tether`` limited to ``tether:*`` keys; the
writer, the reader and the prompt queue run through ``redis://tether:PW@host:port/0`` exactly as a
deployment configures ``buffer.redis_url``. The ACL really limits (a key outside ``tether:*`` is
refused), and a wrong password, an unknown user or no credentials give the one-line RedisUnavailable
message — with the password redacted — instead of a traceback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from buffer import PromptQueue, RedisKeys, TrajectoryReader, TrajectoryWriter, buffer_stats
from tests.unit.test_buffer_codec import make_group
from tether.config.buffer import BufferConfig
from tether.redis_server import EmbeddedRedis, RedisUnavailable, bundled_redis_executable, connect_redis
from tether.v1.trajectory_pb2 import Prompt

pytestmark = pytest.mark.slow

ADMIN_PW = "admin-Pw-0001"
USER_PW = "user-Pw-0002"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """Port of a Redis that needs a password, with the ACL user ``tether`` created by the admin."""
    server = EmbeddedRedis(
        tmp_path_factory.mktemp("redis-auth"), password=ADMIN_PW, executable=bundled_redis_executable()
    )
    server.start()
    admin = redis.Redis(host="127.0.0.1", port=server.port, password=ADMIN_PW)
    admin.execute_command("ACL", "SETUSER", "tether", "on", f">{USER_PW}", "~tether:*", "+@all")
    admin.close()
    yield server.port
    server.stop()


def test_buffer_runs_through_an_acl_user(secured: int) -> None:
    client = connect_redis(f"redis://tether:{USER_PW}@127.0.0.1:{secured}/0")
    assert client.acl_whoami() in ("tether", b"tether")
    keys, cfg = RedisKeys("acl-run"), BufferConfig(claim_idle_ms=200, put_timeout_s=0.3)
    writer, reader = TrajectoryWriter(client, keys, cfg), TrajectoryReader(client, keys, cfg)
    ids = [writer.put(make_group(seed=i)) for i in range(3)]
    got = reader.read(3, current_version=2, max_staleness=1, block_ms=300)
    assert [b.entry_id for b in got] == ids
    reader.ack(ids)
    assert buffer_stats(client, keys)["buffer/acknowledged"] == 3

    queue = PromptQueue(client, keys, claim_idle_ms=100)
    source = iter([Prompt(prompt_id=str(i), dataset_index=i, text=f"q{i}") for i in range(8)])
    assert queue.feed(source, version=0, prompts_per_version=2, max_staleness=1) == 4
    taken = queue.read("server-a", count=4, block_ms=200)
    assert [p.dataset_index for _, p in taken] == [0, 1, 2, 3]
    queue.ack([eid for eid, _ in taken])

    with pytest.raises(redis.exceptions.NoPermissionError):  # the ACL confines the user to tether:*
        client.set("not-tether", b"x")
    client.close()


@pytest.mark.parametrize(
    ("userinfo", "words"),
    [
        (f"tether:wrong-{USER_PW}", "refused the credentials"),
        (f"nobody:{USER_PW}", "refused the credentials"),
        (f":wrong-{ADMIN_PW}", "refused the credentials"),
        ("", "requires a password"),
    ],
    ids=["wrong-password", "unknown-user", "wrong-default-password", "no-credentials"],
)
def test_bad_credentials_give_one_clear_line(secured: int, userinfo: str, words: str) -> None:
    url = f"redis://{userinfo + '@' if userinfo else ''}127.0.0.1:{secured}/0"
    with pytest.raises(RedisUnavailable) as err:
        connect_redis(url, timeout_s=2)
    message = str(err.value)
    assert "\n" not in message and words in message, message
    assert "buffer.redis_url" in message
    assert USER_PW not in message and ADMIN_PW not in message  # never echo a secret into logs


def test_protected_mode_binds_loopback_only(secured: int, tmp_path: Path) -> None:
    """The embedded server listens on 127.0.0.1 only: nothing off the machine can reach it at all."""
    admin = redis.Redis(host="127.0.0.1", port=secured, password=ADMIN_PW)
    try:
        assert admin.config_get("bind")["bind"] == "127.0.0.1"
        assert admin.config_get("protected-mode")["protected-mode"] == "yes"
    finally:
        admin.close()
