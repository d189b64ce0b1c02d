"""The relay (issue 33): chunks kept in memory, fetched upstream once, never served when they fail their hash.

The relay runs as it does in ``tether relay``: ``serve(CachingProvider([RemoteSource(origin)]))`` on a free
loopback port, in front of an origin serving a store written by VersionWriter; readers fetch through it with
the Fetcher. The subprocess version (killed mid-fetch) is tests/integration/test_relay_process.py.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.unit.test_chunk_service import publish, same_bits, unique_chunk
from tether.redis_server import free_port
from weight_sync.chunk_service import ChunkServer, RemoteSource, serve
from weight_sync.manifest import content_hash
from weight_sync.relay import CachingProvider, ChunkCache
from weight_sync.sources import DirSource, Fetcher, ProviderSource, SourceUnavailable
from weight_sync.store import VersionMissing, VersionStore
from weight_sync.versions import ChunkCorrupt, ChunkMissing


def _chunk(k: int, size: int = 100) -> tuple[str, bytes]:
    data = bytes([k % 256]) * size
    return content_hash(data), data


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Wait for a state (not a time): fails only when the state never comes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


# -- ChunkCache ------------------------------------------------------------------------------------------------
def test_cache_evicts_the_least_recently_used_by_bytes() -> None:
    cache = ChunkCache(capacity_bytes=300)
    chunks = [_chunk(k) for k in range(4)]
    for digest, data in chunks[:3]:
        cache.put(digest, data)
    assert cache.get(chunks[0][0]) == chunks[0][1]  # now the most recently used
    cache.put(*chunks[3])
    assert chunks[1][0] not in cache and cache.get(chunks[1][0]) is None
    assert all(d in cache for d, _ in (chunks[0], chunks[2], chunks[3]))
    assert cache.nbytes == 300 and len(cache) == 3


def test_cache_refuses_bytes_that_fail_their_hash() -> None:
    cache = ChunkCache(capacity_bytes=1000)
    digest, data = _chunk(1)
    assert cache.expect(digest)
    with pytest.raises(ChunkCorrupt, match="do not match their hash"):
        cache.put(digest, data[:-1] + b"\x00")
    assert digest not in cache and cache.nbytes == 0
    assert not cache.expect(digest)  # still on its way: the caller may try another source
    cache.put(digest, data)
    assert cache.get(digest) == data


def test_cache_waiters_get_the_chunk_or_none() -> None:
    cache = ChunkCache(capacity_bytes=50)  # smaller than the chunk: waiters get it even though it is not kept
    digest, data = _chunk(2)
    other, _ = _chunk(3)
    assert cache.expect(digest) and not cache.expect(digest)
    assert cache.expect(other)
    got: dict[str, bytes | None] = {}
    waiters = [
        threading.Thread(target=lambda d=d: got.__setitem__(d, cache.get(d, wait_s=30))) for d in (digest, other)
    ]
    for t in waiters:
        t.start()
    cache.put(digest, data)
    cache.fail(other)
    for t in waiters:
        t.join()
    assert got == {digest: data, other: None}
    assert digest not in cache and cache.get(other, wait_s=30) is None  # nothing on its way: no wait


# -- the relay over gRPC ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> VersionStore:
    return publish(tmp_path_factory.mktemp("store"))


@pytest.fixture(scope="module")
def origin(store: VersionStore) -> Iterator[ChunkServer]:
    with serve(DirSource(store.root)) as server:
        yield server


class Relay:
    """A relay server over ``upstream`` and a reader's source for it."""

    def __init__(self, upstream: list, cache_bytes: int = 64 << 20) -> None:
        self.provider = CachingProvider(upstream, cache_bytes=cache_bytes, chunk_timeout_s=30)
        self.server = serve(self.provider)
        self.source = RemoteSource(self.server.address, kind="relay")

    def close(self) -> None:
        self.source.close()
        self.server.stop(0)
        for s in self.provider.sources():
            if isinstance(s, RemoteSource):
                s.close()


@pytest.fixture
def relays() -> Iterator[Callable[..., Relay]]:
    made: list[Relay] = []

    def make(upstream: list, **kw: int) -> Relay:
        made.append(Relay(upstream, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_a_fleet_fetches_through_the_relay_and_the_origin_sends_once(
    store: VersionStore, origin: ChunkServer, relays: Callable[..., Relay]
) -> None:
    relay = relays([RemoteSource(origin.address, kind="origin")])
    first, stats = Fetcher([relay.source]).fetch(6)
    assert same_bits(first, store.fetch(6)) and stats.bytes_by_source == {relay.source.name: first.fetched_bytes}
    named = [c.hash for m in store.plan(6) for c in m.chunks]
    assert len(set(named)) == len(named) > 1  # every chunk of the chain is distinct: one miss each
    counts = relay.provider.counters
    assert counts["misses"] == counts["cached_chunks"] == len(named) and counts["hits"] == 0
    assert counts["upstream_bytes"] == counts["served_bytes"] == first.fetched_bytes

    second, _ = Fetcher([relay.source]).fetch(6)  # another server: all from memory
    held = store.fetch(5)
    third, _ = Fetcher([relay.source]).fetch(6, held=held)  # one already at v5: the v6 delta, also in memory
    assert same_bits(second, first) and same_bits(third, first)
    after = relay.provider.counters
    assert after["upstream_bytes"] == counts["upstream_bytes"] and after["misses"] == counts["misses"]
    assert after["served_bytes"] == 2 * first.fetched_bytes + third.fetched_bytes
    assert after["corrupt"] == after["upstream_failures"] == after["unavailable"] == 0


def _flip_on_disk(store: VersionStore, digest: str) -> None:
    path = store.chunk_path(digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_byte_flipped_on_disk_is_neither_cached_nor_served(
    tmp_path: Path, store: VersionStore, relays: Callable[..., Relay]
) -> None:
    """The relay's only upstream serves a rotten chunk: the relay refuses it (counted) and says it does not hold
    it, so the reader takes that chunk from its next source; nothing corrupt reaches the reader at all."""
    good = store
    bad = VersionStore(shutil.copytree(store.root, tmp_path / "rotten"), fsync=False)
    digest = unique_chunk(bad, 6, "delta")
    _flip_on_disk(bad, digest)
    with serve(DirSource(bad.root)) as bad_origin:
        relay = relays([RemoteSource(bad_origin.address, kind="origin")])
        fallback = ProviderSource(DirSource(good.root), name="dir:good")
        got, stats = Fetcher([relay.source, fallback]).fetch(6)
        counts = relay.provider.counters
    assert same_bits(got, good.fetch(6))
    assert counts["corrupt"] == 1 and counts["unavailable"] == 1
    assert digest not in relay.provider.cache
    assert stats.corrupt == 0 and stats.missing == 1  # the relay said "not held", it never sent the bad bytes
    assert stats.bytes_by_source[fallback.name] == good.chunk_path(digest).stat().st_size
    assert relay.source.name not in stats.failed_sources


def test_the_relay_asks_its_next_upstream_for_a_rotten_chunk(
    tmp_path: Path, store: VersionStore, origin: ChunkServer, relays: Callable[..., Relay]
) -> None:
    bad = VersionStore(shutil.copytree(store.root, tmp_path / "rotten"), fsync=False)
    digest = unique_chunk(bad, 6, "delta")
    _flip_on_disk(bad, digest)
    with serve(DirSource(bad.root)) as bad_origin:
        relay = relays([RemoteSource(bad_origin.address, kind="origin"), RemoteSource(origin.address, kind="origin")])
        got, stats = Fetcher([relay.source]).fetch(6)
        counts = relay.provider.counters
    assert same_bits(got, store.fetch(6))
    assert counts["corrupt"] == 1 and counts["unavailable"] == 0 and stats.corrupt == 0
    assert relay.provider.cache.get(digest) == store.chunk_path(digest).read_bytes()


class Gated:
    """An upstream source that counts chunk requests and holds each until released."""

    def __init__(self, inner: ProviderSource, *, missing: bool = False) -> None:
        self.inner, self.missing = inner, missing
        self.name = "gated"
        self.calls: Counter[str] = Counter()
        self.release = threading.Event()

    def plan(self, version, held):
        return self.inner.plan(version, held)

    def chunk(self, digest: str, *, timeout_s: float) -> bytes:
        self.calls[digest] += 1
        self.release.wait(60)
        if self.missing:
            raise ChunkMissing(f"gated: no chunk {digest}")
        return self.inner.chunk(digest, timeout_s=timeout_s)


@pytest.mark.parametrize("readers", [2, 6])
def test_concurrent_requests_for_a_chunk_make_one_upstream_fetch(
    store: VersionStore, relays: Callable[..., Relay], readers: int
) -> None:
    gated = Gated(ProviderSource(DirSource(store.root)))
    relay = relays([gated])
    digest = store.manifest(6, "delta").chunks[0].hash
    got: list[bytes] = []
    threads = [threading.Thread(target=lambda: got.append(relay.source.chunk(digest, timeout_s=60))) for _ in
               range(readers)]  # fmt: skip
    for t in threads:
        t.start()
    try:
        _until(lambda: relay.provider.counters["coalesced"] == readers - 1, f"{readers - 1} requests waiting")
    finally:
        gated.release.set()
    for t in threads:
        t.join()
    assert got == [store.chunk_path(digest).read_bytes()] * readers
    assert gated.calls == {digest: 1}
    counts = relay.provider.counters
    assert (counts["misses"], counts["coalesced"], counts["upstream_bytes"]) == (1, readers - 1, len(got[0]))


def test_waiters_are_released_when_the_one_fetch_fails(store: VersionStore) -> None:
    gated = Gated(ProviderSource(DirSource(store.root)), missing=True)
    provider = CachingProvider([gated], cache_bytes=1 << 20, chunk_timeout_s=60)
    digest = store.manifest(6, "delta").chunks[0].hash
    got: list[bytes | None] = []
    threads = [threading.Thread(target=lambda: got.append(provider.chunk(digest, wait_s=60))) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        _until(lambda: provider.counters["coalesced"] == 2, "2 requests waiting")
    finally:
        gated.release.set()
    for t in threads:
        t.join()
    assert got == [None] * 3 and gated.calls == {digest: 1} and provider.counters["unavailable"] == 1
    assert provider.cache.expect(digest)  # nothing left on its way: the next request fetches afresh


class CountingPlans:
    def __init__(self, inner: ProviderSource) -> None:
        self.inner, self.name, self.plans = inner, "counting", 0

    def plan(self, version, held):
        self.plans += 1
        return self.inner.plan(version, held)

    def chunk(self, digest: str, *, timeout_s: float) -> bytes:
        return self.inner.chunk(digest, timeout_s=timeout_s)


def test_plans_of_a_fixed_version_are_kept_the_latest_always_goes_upstream(store: VersionStore) -> None:
    upstream = CountingPlans(ProviderSource(DirSource(store.root)))
    provider = CachingProvider([upstream], cache_bytes=1 << 20)
    expected = store.plan(6, 5)
    assert provider.plan(6, 5) == provider.plan(6, 5) == expected
    assert upstream.plans == 1
    assert provider.plan(None, None) == provider.plan(None, None) == store.plan(6)
    assert upstream.plans == 3
    assert provider.plan(6, None) == store.plan(6)  # kept under the version "the latest" turned out to be
    assert upstream.plans == 3 and provider.counters["plan_hits"] == 2
    with pytest.raises(VersionMissing, match="no upstream can plan v99"):
        provider.plan(99, None)


def test_a_relay_whose_upstream_is_down(relays: Callable[..., Relay]) -> None:
    """Plans: UNAVAILABLE (the reader skips the relay); chunks: not held (the reader asks its next source)."""
    relay = relays([RemoteSource(f"127.0.0.1:{free_port()}", kind="origin")])
    with pytest.raises(SourceUnavailable, match=r"relay:.*GetPlan failed: UNAVAILABLE: .*no upstream answered"):
        relay.source.plan(None, None)
    with pytest.raises(ChunkMissing):
        relay.source.chunk("0" * 32, timeout_s=10)
    counts = relay.provider.counters
    assert counts["upstream_failures"] == 2 and counts["unavailable"] == 1
