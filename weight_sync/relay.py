"""A relay: a chunk service that fetches each chunk from upstream once and answers the fleet from memory.

One learner serving every rollout server itself sends each version's bytes once per server; a ``tether relay``
(or several, one per rack) between them turns that into once per relay. :class:`CachingProvider` is the
:class:`~weight_sync.sources.Provider` a relay serves (``weight_sync.chunk_service.serve``): plans come from
the first upstream that can plan (a fixed version's plan is kept a few seconds; "the latest" always goes
upstream, or a relay would hide new versions), chunks from :class:`ChunkCache`. On a miss the relay fetches
the chunk from the first upstream whose bytes match the hash — a corrupt copy is counted and the next
upstream asked, and never cached or served — and requests for a chunk already on its way wait for that one
fetch instead of starting their own, so a fleet asking for a new version at once costs one upstream fetch
per chunk.

:class:`ChunkCache` is also what a rollout server keeps the chunks it fetched in, to serve its peers:
``expect`` the chunks of a plan before fetching them, ``put`` each as it arrives (the Fetcher's ``on_chunk``),
``fail`` the rest if the fetch fails; a peer's ``get(digest, wait_s=...)`` waits for a chunk still on its way.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from tether.logs import get_logger
from weight_sync.manifest import Manifest, WeightVersionError, content_hash
from weight_sync.sources import Source, SourceUnavailable
from weight_sync.store import VersionMissing
from weight_sync.versions import ChunkCorrupt, ChunkMissing

log = get_logger(__name__)


class _Pending:
    """A chunk on its way: waiters hold this, so they get the bytes even if the cache evicts them at once."""

    __slots__ = ("data", "done")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.data: bytes | None = None


class ChunkCache:
    """Verified chunks in memory, least recently used evicted beyond ``capacity_bytes``, and the chunks on their
    way (:meth:`expect`), which :meth:`get` can wait for. Thread-safe."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, not {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._chunks: OrderedDict[str, bytes] = OrderedDict()
        self._pending: dict[str, _Pending] = {}
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, digest: object) -> bool:
        return digest in self._chunks

    def knows(self, digest: str) -> bool:
        """Whether ``digest`` is held or on its way."""
        with self._lock:
            return digest in self._chunks or digest in self._pending

    def expect(self, digest: str) -> bool:
        """Mark ``digest`` as on its way; False (nothing marked) when it is held or already on its way, in which
        case :meth:`get` with a wait returns it. The caller that got True must :meth:`put` or :meth:`fail` it."""
        with self._lock:
            if digest in self._chunks or digest in self._pending:
                return False
            self._pending[digest] = _Pending()
            return True

    def put(self, digest: str, data: bytes) -> None:
        """Keep ``data`` as chunk ``digest`` and hand it to whoever waits for it. Raises :class:`ChunkCorrupt`
        (keeping nothing, leaving the chunk on its way) when the bytes do not hash to ``digest``."""
        if content_hash(data) != digest:
            raise ChunkCorrupt(f"chunk {digest}: {len(data)} bytes that do not match their hash, not cached")
        with self._lock:
            pending = self._pending.pop(digest, None)
            if digest in self._chunks:
                self._chunks.move_to_end(digest)
            elif len(data) <= self.capacity_bytes:
                self._chunks[digest] = data
                self._bytes += len(data)
                while self._bytes > self.capacity_bytes:
                    _, old = self._chunks.popitem(last=False)
                    self._bytes -= len(old)
        if pending is not None:
            pending.data = data
            pending.done.set()

    def fail(self, digest: str) -> None:
        """``digest`` is no longer on its way: its waiters get None now."""
        with self._lock:
            pending = self._pending.pop(digest, None)
        if pending is not None:
            pending.done.set()

    def get(self, digest: str, *, wait_s: float = 0.0) -> bytes | None:
        """The chunk's bytes, or None when not held; a chunk on its way is waited for up to ``wait_s``."""
        with self._lock:
            data = self._chunks.get(digest)
            if data is not None:
                self._chunks.move_to_end(digest)
                return data
            pending = self._pending.get(digest)
        if pending is None or wait_s <= 0:
            return None
        pending.done.wait(wait_s)
        return pending.data


class CachingProvider:
    """A :class:`~weight_sync.sources.Provider` over ``upstream`` sources (asked in order; a callable is read
    afresh on every call) with ``cache_bytes`` of chunks in memory; see the module docstring.

    ``chunk_timeout_s``: the deadline of each upstream chunk request, and how long a request for a chunk another
    request is fetching waits when it names no ``wait_s`` of its own. ``plan_ttl_s``: how long the plan of a
    fixed (version, held) is reused."""

    def __init__(
        self,
        upstream: Sequence[Source] | Callable[[], Sequence[Source]],
        *,
        cache_bytes: int,
        chunk_timeout_s: float = 30.0,
        plan_ttl_s: float = 5.0,
        name: str = "relay",
    ) -> None:
        self._upstream = upstream
        self.cache = ChunkCache(cache_bytes)
        self.chunk_timeout_s, self.plan_ttl_s, self.name = chunk_timeout_s, plan_ttl_s, name
        self._plans: dict[tuple[int, int | None], tuple[float, list[Manifest]]] = {}
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("hits", "misses", "coalesced", "unavailable", "corrupt", "upstream_failures", "upstream_bytes",
             "served_bytes", "plans", "plan_hits"), 0)  # fmt: skip

    def sources(self) -> list[Source]:
        return list(self._upstream() if callable(self._upstream) else self._upstream)

    @property
    def counters(self) -> dict[str, int]:
        """``hits`` (served from memory), ``misses`` (fetched upstream), ``coalesced`` (waited for another
        request's fetch), ``unavailable`` (no upstream served good bytes), ``corrupt`` (upstream bytes that failed
        their hash), ``upstream_failures`` (upstream calls that failed), bytes in and out, plans asked and
        answered from memory, and what the cache holds."""
        with self._lock:
            out = dict(self._counts)
        out.update(cached_chunks=len(self.cache), cached_bytes=self.cache.nbytes)
        return out

    def _add(self, **counts: int) -> None:
        with self._lock:
            for key, n in counts.items():
                self._counts[key] += n

    # -- plans ---------------------------------------------------------------------------------------------------
    def plan(self, version: int | None, held: int | None) -> list[Manifest]:
        self._add(plans=1)
        now = time.monotonic()
        if version is not None:
            with self._lock:
                kept = self._plans.get((version, held))
            if kept is not None and kept[0] > now:
                self._add(plan_hits=1)
                return list(kept[1])
        said, missing = [], False
        for source in self.sources():
            try:
                chain = source.plan(version, held)
            except VersionMissing as e:
                said.append(f"{source.name}: {e}")
                missing = True
                continue
            except WeightVersionError as e:
                self._add(upstream_failures=1)
                said.append(f"{source.name}: {e}")
                continue
            if chain:  # "the latest" is kept under the version it turned out to be
                with self._lock:
                    self._plans = {k: v for k, v in self._plans.items() if v[0] > now}
                    self._plans[(chain[-1].version, held)] = (now + self.plan_ttl_s, chain)
            return list(chain)
        wanted = "the latest version" if version is None else f"v{version}"
        why = "; ".join(said) or "no upstream configured"
        if missing:
            raise VersionMissing(f"{self.name}: no upstream can plan {wanted}: {why}")
        raise SourceUnavailable(f"{self.name}: no upstream answered for {wanted}: {why}")

    # -- chunks --------------------------------------------------------------------------------------------------
    def chunk(self, digest: str, *, wait_s: float = 0.0) -> bytes | None:
        data = self.cache.get(digest)
        if data is not None:
            self._add(hits=1, served_bytes=len(data))
            return data
        if not self.cache.expect(digest):  # another request is fetching it (or just has): wait for that one
            self._add(coalesced=1)
            data = self.cache.get(digest, wait_s=wait_s if wait_s > 0 else self.chunk_timeout_s)
        else:
            self._add(misses=1)
            try:
                data = self._fetch(digest)
            finally:
                if data is None:
                    self.cache.fail(digest)
        if data is not None:
            self._add(served_bytes=len(data))
        return data

    def _fetch(self, digest: str) -> bytes | None:
        for source in self.sources():
            try:
                data = source.chunk(digest, timeout_s=self.chunk_timeout_s)
            except ChunkMissing:
                continue
            except WeightVersionError as e:
                self._add(upstream_failures=1)
                log.warning("relay_upstream_failed", source=source.name, chunk=digest, error=str(e))
                continue
            try:
                self.cache.put(digest, data)  # hashes the bytes: a corrupt copy is neither kept nor served
            except ChunkCorrupt:
                self._add(corrupt=1)
                log.warning("relay_chunk_corrupt", source=source.name, chunk=digest, size=len(data))
                continue
            self._add(upstream_bytes=len(data))
            return data
        self._add(unavailable=1)
        return None
