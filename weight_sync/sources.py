"""Where a server fetches a published version from, and the fetch that checks every byte.

A version's manifests and chunks can come from several places (:class:`Source`): the store directory
itself when the server mounts it (:class:`DirSource`), a copy of the store (``weight_sync.mirrors``), the
learner's chunk service (the *origin*), a ``tether relay``, or a peer server that already holds the version
(``weight_sync.chunk_service``'s ``RemoteSource`` for the last three). :class:`Fetcher` asks them in order:
the plan (the manifests to apply, a few KiB) from the first that has it, and each chunk from the first
that serves bytes matching the chunk's hash. A chunk whose bytes fail their hash is asked of the next
source and never decoded; a source that fails (refused, killed mid-transfer, past its deadline) is skipped
for the rest of the fetch. Every refetch and every failure is counted (:class:`FetchStats`), and a fetch
whose chunk no source can serve fails with an error naming the version, chunk, tensors and what each source
said — the server keeps the weights it has.

The same objects serve: a :class:`Provider` is what a chunk service answers from (a store directory, or
what a server holds: ``weight_sync.puller``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tether.logs import get_logger
from weight_sync.manifest import Manifest, WeightVersionError, content_hash
from weight_sync.store import VersionMissing, VersionStore
from weight_sync.versions import ChunkCorrupt, ChunkMissing, Weights, decode_version, describe

log = get_logger(__name__)


class SourceUnavailable(WeightVersionError):
    """A source that could not answer at all (refused, gone, past its deadline): skipped for this fetch."""


class Provider(Protocol):
    """What a chunk service serves from."""

    def plan(self, version: int | None, held: int | None) -> list[Manifest]:
        """The manifests that take a reader from ``held`` (None: nothing) to ``version`` (None: the latest),
        in order; raises :class:`VersionMissing` when this provider cannot say."""

    def chunk(self, digest: str, *, wait_s: float = 0.0) -> bytes | None:
        """The stored bytes named ``digest``, or None when not held here. ``wait_s``: a chunk this provider
        is itself fetching right now may be waited for that long (a peer in the fan-out tree)."""


class Source(Protocol):
    """What a fetch reads from: a provider, here or across the network."""

    name: str
    """For logs and errors: ``dir:/path``, ``origin:host:port``, ``relay:…``, ``peer:…``, ``mirror:<url>``; the
    part before the first colon is the kind a server counts its bytes by."""

    def plan(self, version: int | None, held: int | None) -> list[Manifest]:
        """As :meth:`Provider.plan`; raises :class:`VersionMissing` or :class:`SourceUnavailable`."""

    def chunk(self, digest: str, *, timeout_s: float) -> bytes:
        """The chunk's stored bytes (not yet checked); raises :class:`ChunkMissing` when the source does not
        hold it, :class:`SourceUnavailable` when it cannot answer within ``timeout_s``."""


class DirSource:
    """A :class:`Provider` over a store directory: the learner's origin service, a relay over a mounted
    store, and (through :class:`ProviderSource`) a server that mounts the store itself."""

    def __init__(self, root: str | Path) -> None:
        self.store = VersionStore(root, fsync=False)
        self.name = f"dir:{self.store.root}"

    def plan(self, version: int | None, held: int | None) -> list[Manifest]:
        if version is None:
            version = self.store.latest()
            if version is None:
                raise VersionMissing(f"{self.store.root}: no version published yet")
        return self.store.plan(version, held)

    def chunk(self, digest: str, *, wait_s: float = 0.0) -> bytes | None:
        try:
            return self.store.chunk_path(digest).read_bytes()
        except FileNotFoundError:
            return None


class ProviderSource:
    """A :class:`Provider` in this process read as a :class:`Source`."""

    def __init__(self, provider: Provider, name: str | None = None) -> None:
        self.provider = provider
        self.name = name or getattr(provider, "name", type(provider).__name__)

    def plan(self, version: int | None, held: int | None) -> list[Manifest]:
        return self.provider.plan(version, held)

    def chunk(self, digest: str, *, timeout_s: float) -> bytes:
        data = self.provider.chunk(digest, wait_s=timeout_s / 2)
        if data is None:
            raise ChunkMissing(f"{self.name}: no chunk {digest}")
        return data


@dataclass
class FetchStats:
    """What one fetch took, by source; merged into the server's counters."""

    bytes_by_source: dict[str, int] = field(default_factory=dict)
    corrupt: int = 0
    """Chunks whose bytes failed their hash (each asked again of the next source, never decoded)."""
    missing: int = 0
    failed_sources: dict[str, str] = field(default_factory=dict)
    manifests: list[Manifest] = field(default_factory=list)

    @property
    def chain(self) -> tuple[str, ...]:
        """The manifests applied, e.g. ``("v20.base", "v21.delta")``."""
        return tuple(f"v{m.version}.{m.kind}" for m in self.manifests)

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_source.values())


class Fetcher:
    """Fetch a version from ``sources`` (asked in order), checking every chunk; see the module docstring.

    ``sources`` may be a callable, so the list is read afresh for every fetch (peers come and go)."""

    def __init__(
        self,
        sources: Sequence[Source] | Callable[[], Sequence[Source]],
        *,
        chunk_timeout_s: float = 30.0,
        on_chunk: Callable[[str, bytes], None] | None = None,
        on_plan: Callable[[list[Manifest]], None] | None = None,
        parallel: int = 4,
    ) -> None:
        self._sources = sources
        self.chunk_timeout_s = chunk_timeout_s
        self.parallel = max(1, parallel)
        """Chunk requests in flight at once (each source request is one chunk)."""
        self.on_chunk = on_chunk
        """Called with (hash, stored bytes) of every verified chunk, before it is decoded (a server keeps
        them to serve its peers)."""
        self.on_plan = on_plan
        """Called with the manifests about to be applied, before any chunk is fetched (a server marks their
        chunks as in flight, so a peer asking for one waits instead of hearing "not held")."""

    def sources(self) -> list[Source]:
        return list(self._sources() if callable(self._sources) else self._sources)

    def plan(
        self, version: int | None, held: int | None, sources: Sequence[Source], stats: FetchStats
    ) -> list[Manifest]:
        errors = []
        for source in sources:
            if source.name in stats.failed_sources:
                continue
            try:
                return source.plan(version, held)
            except SourceUnavailable as e:
                stats.failed_sources[source.name] = str(e)
                errors.append(f"{source.name}: {e}")
            except WeightVersionError as e:  # VersionMissing, or a manifest that does not parse: ask the next
                errors.append(f"{source.name}: {e}")
        wanted = "the latest version" if version is None else f"v{version}"
        raise VersionMissing(f"no source can plan {wanted}: " + "; ".join(errors))

    def fetch(
        self,
        version: int | None,
        *,
        held: Weights | None = None,
        reuse: Weights | None = None,
    ) -> tuple[Weights, FetchStats]:
        """Version ``version`` (None: the newest any source has), from ``held`` where the plan says so.

        ``held`` is never modified (a chain's intermediate versions are decoded in place in the buffer
        of the result); ``reuse``: weights the caller is done with, whose buffer receives the result."""
        stats = FetchStats()
        sources = self.sources()
        if not sources:
            raise VersionMissing("no source to fetch weights from")
        chain = self.plan(version, None if held is None else held.version, sources, stats)
        stats.manifests = list(chain)
        if self.on_plan is not None:
            self.on_plan(chain)
        if not chain:
            if held is None:
                raise VersionMissing(f"the plan for v{version} from nothing is empty")
            return held, stats
        current = held
        with ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix="weight-fetch") as pool:
            try:
                for m in chain:
                    own = current is not None and current is not held
                    current = decode_version(
                        m, self._reader(m, sources, stats, pool), current, in_place=own, reuse=None if own else reuse
                    )
            except BaseException:
                pool.shutdown(wait=True, cancel_futures=True)  # nothing fetched for a decode that is over
                raise
        assert current is not None
        current.fetched_bytes = stats.bytes
        return current, stats

    def _reader(
        self, manifest: Manifest, sources: Sequence[Source], stats: FetchStats, pool: ThreadPoolExecutor
    ) -> Callable[[int], bytes]:
        """``read(k)``: chunk k's verified bytes. Chunks are fetched ``parallel`` at a time ahead of the decode
        (in manifest order), so per-request latency overlaps instead of adding up."""
        lock = threading.Lock()
        ahead: dict[int, Future[bytes]] = {}

        def fetch(k: int) -> bytes:
            digest = manifest.chunks[k].hash
            said, corrupt = [], False
            for source in sources:
                if source.name in stats.failed_sources:
                    continue
                try:
                    data = source.chunk(digest, timeout_s=self.chunk_timeout_s)
                except ChunkMissing:
                    with lock:
                        stats.missing += 1
                    said.append(f"{source.name}: not held")
                    continue
                except SourceUnavailable as e:
                    with lock:
                        stats.failed_sources[source.name] = str(e)
                    said.append(f"{source.name}: {e}")
                    log.warning("weight_source_failed", source=source.name, error=str(e))
                    continue
                if content_hash(data) != digest:
                    with lock:
                        stats.corrupt += 1
                    corrupt = True
                    said.append(f"{source.name}: bytes fail their hash")
                    log.warning("weight_chunk_corrupt", source=source.name, chunk=describe(manifest, k))
                    continue
                with lock:
                    stats.bytes_by_source[source.name] = stats.bytes_by_source.get(source.name, 0) + len(data)
                if self.on_chunk is not None:
                    self.on_chunk(digest, data)
                return data
            error = ChunkCorrupt if corrupt else ChunkMissing
            raise error(f"{describe(manifest, k)}: no source served it ({'; '.join(said) or 'no source left'})")

        def read(k: int) -> bytes:
            for j in range(k, min(k + self.parallel, len(manifest.chunks))):
                if j not in ahead:
                    ahead[j] = pool.submit(fetch, j)
            return ahead.pop(k).result()

        return read
