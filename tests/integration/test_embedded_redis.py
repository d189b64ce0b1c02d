"""The embedded Redis: a real redis-server that starts, serves, stops, and never outlives its parent."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis

from tests.helpers import alive, interruptible, wait_gone
from tether.redis_server import EmbeddedRedis, RedisUnavailable, connect_redis, free_port


def test_start_xadd_stop_leaves_no_process(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    assert server.process is not None
    pid = server.process.pid
    client = connect_redis(url)
    entry = client.xadd("tether:t:trajectories", {"data": b"\x00\x01"})
    assert client.xlen("tether:t:trajectories") == 1
    assert client.xrange("tether:t:trajectories")[0] == (entry, {b"data": b"\x00\x01"})
    assert client.info("server")["redis_version"].startswith(("6.2", "7", "8"))
    client.close()
    server.stop()
    assert wait_gone(pid)
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=1).ping()


def test_context_manager_stops_on_exception(tmp_path: Path) -> None:
    server = EmbeddedRedis(tmp_path / "redis")
    with pytest.raises(RuntimeError, match="boom"), server:
        pid = server.process.pid
        raise RuntimeError("boom")
    assert wait_gone(pid)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT])
def test_no_orphan_when_the_parent_dies(tmp_path: Path, how: int) -> None:
    """SIGKILL: the kernel's parent-death signal ends Redis. SIGINT (Ctrl-C): the context manager does."""
    script = textwrap.dedent(f"""
        import sys, time
        from tether.redis_server import EmbeddedRedis
        with EmbeddedRedis({str(tmp_path / "redis")!r}) as url:
            print(url.rsplit(':', 1)[1].split('/')[0], flush=True)
            time.sleep(600)
    """)
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, preexec_fn=interruptible
    )
    port = int(parent.stdout.readline())
    client = redis.Redis(port=port)
    redis_pid = int(client.info("server")["process_id"])
    client.close()
    assert alive(redis_pid)
    parent.send_signal(how)
    parent.wait(timeout=30)
    assert wait_gone(redis_pid), "embedded redis outlived its parent"


def test_password_through_the_url(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "redis", password="s3cret") as url:
        assert ":s3cret@" in url
        assert connect_redis(url).ping()
        port = url.rsplit(":", 1)[1].split("/")[0]
        with pytest.raises(RedisUnavailable, match="refused the credentials"):
            connect_redis(f"redis://127.0.0.1:{port}/0")
        with pytest.raises(RedisUnavailable, match=r"redis://:\*\*\*@127.0.0.1"):
            connect_redis(f"redis://:wrong@127.0.0.1:{port}/0")


def test_unreachable_redis_is_one_clear_message() -> None:
    with pytest.raises(RedisUnavailable) as info:
        connect_redis(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1)
    message = str(info.value)
    assert "buffer.redis_url: cannot connect" in message and "leave redis_url empty" in message
    assert "\n" not in message


def test_appendonly_survives_restart(tmp_path: Path) -> None:
    data = tmp_path / "redis"
    with EmbeddedRedis(data, appendonly=True) as url:
        client = connect_redis(url)
        client.xadd("s", {"k": b"v"})
        client.close()
    with EmbeddedRedis(data, appendonly=True) as url:
        assert connect_redis(url).xlen("s") == 1


def test_busy_fixed_port_is_reported(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path / "a") as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(RedisUnavailable, match="did not start"):
            EmbeddedRedis(tmp_path / "b", port=port, start_timeout_s=3).start()


def test_a_clean_stop_keeps_the_data_for_the_next_start_only(tmp_path: Path) -> None:
    """``stop(save=True)`` (what ``tether up`` does at the end) keeps the data for the next start; that start
    consumes it, so a later crash (which saves nothing) comes back empty rather than with old data."""
    folder = tmp_path / "redis"
    server = EmbeddedRedis(folder)
    client = connect_redis(server.start())
    client.hset("tether:r:counters", "prompts_issued", 42)
    client.close()
    server.stop(save=True)
    assert (folder / "dump.rdb").exists()

    server = EmbeddedRedis(folder)
    client = connect_redis(server.start())
    assert client.hget("tether:r:counters", "prompts_issued") == b"42"
    assert not (folder / "dump.rdb").exists()
    client.close()
    server.stop()  # not saved: as if the run had crashed

    server = EmbeddedRedis(folder)
    client = connect_redis(server.start())
    assert client.hget("tether:r:counters", "prompts_issued") is None
    client.close()
    server.stop()
