"""A rollout server's side of the ``store`` transport: learn of a version, pull it, verify it, swap.

    announced v (Redis, polled every ``poll_s``) ─► plan + chunks from the sources, every hash checked
    (``sources.Fetcher``): the store if mounted, my parent in the fan-out tree, mirrors, relays, the origin
    ─► decode against the version held, into the spare buffer ─► at the engine's safe point: pause,
    ``load_pulled`` (the engine adopts the buffer or copies it), ``policy_version = v``, resume
    ─► record v (Redis) and serve its chunks to peers

No global pause and no handshake: each server swaps when its bytes are in, and in-flight requests keep
going as the server's ``inflight`` setting says (their tokens carry the version that produced them). A
server that is new or behind fetches the newest base and the deltas after it (the store plans it). A
fetch that fails leaves the server on the weights it has and is tried again at the next poll, backing
off to a second; nothing corrupt is ever decoded (``sources``).

The fan-out tree: the live servers sorted by id, node ``r`` < ``fanout`` fetches from the origin (or a
relay), node ``r`` ≥ ``fanout`` from node ``(r − fanout) // fanout`` first. A parent serves a chunk of
the version it is fetching as soon as it has it (``ChunkCache``: a peer's request waits for a chunk in
flight), so the tree is a pipeline, and the learner sends each version ``fanout`` times however large the
fleet. A server also serves any chunk of a *base* of the version it holds from its decoded weights (a
base chunk is the raw bits, named by their hash), which is what a new server fetches.

Redis is the rollout server's: it passes a :class:`PeerDirectory` in (weight sync never imports the buffer).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from tether import spans
from tether.config import TetherConfig
from tether.logs import get_logger
from weight_sync.loading import Delivery, WeightLoader
from weight_sync.manifest import Manifest
from weight_sync.mirrors import mirror_source
from weight_sync.sources import DirSource, Fetcher, FetchStats, ProviderSource, Source
from weight_sync.store import VersionMissing
from weight_sync.store_publisher import store_root
from weight_sync.versions import Weights

log = get_logger(__name__)


@dataclass(frozen=True)
class Member:
    """A live server as the fleet records it."""

    server_id: str
    version: int
    peer: str
    """Where its chunk service answers (empty: none)."""


class PeerDirectory(Protocol):
    """The run's shared records as a puller reads and writes them: the learner's announcement, the live
    servers with the version each holds and where it serves chunks, and this server's own entry."""

    async def announced(self) -> dict | None:
        """The learner's announcement (``version``, ``origin``), or None before the first."""

    async def members(self) -> list[Member]:
        """The live servers, with what each holds."""

    async def record(self, version: int, peer: str) -> None:
        """Say that this server now serves ``version``."""


def tree_parent(rank: int, fanout: int) -> int | None:
    """The node that node ``rank`` fetches from first; None: a root (fetches from the origin / relays)."""
    if fanout <= 0 or rank < fanout:
        return None
    return (rank - fanout) // fanout


PLAN_GRACE_S = 0.25
"""How long a peer waits for its own fetch of a chunk to begin before it answers "not held"."""


class HeldChunks:
    """What this server serves to its peers: the chunks it fetched (and is fetching: a request waits for
    one in flight), and any base chunk of the version it holds, cut from its decoded weights."""

    def __init__(self, cache_bytes: int) -> None:
        from weight_sync.relay import ChunkCache

        self.cache = ChunkCache(cache_bytes)
        self.name = "held"
        self._weights: Weights | None = None
        self._raw: dict[str, tuple[int, int]] = {}

    def hold(self, weights: Weights, manifest: Manifest) -> None:
        """``weights`` are now served; ``manifest`` (its last one applied) says where each chunk's bits are."""
        self._raw = {c.raw_hash: (c.start, c.count) for c in manifest.chunks}
        self._weights = weights

    def plan(self, version: int | None, held: int | None) -> list[Manifest]:
        raise VersionMissing("a peer serves chunks, not plans")

    def chunk(self, digest: str, *, wait_s: float = 0.0) -> bytes | None:
        span, weights = self._raw.get(digest), self._weights
        if span is not None and weights is not None:
            return weights.bits[span[0] : span[0] + span[1]].tobytes()
        if wait_s > 0 and not self.cache.knows(digest):
            # A child may ask before this server has read the announcement and planned the fetch (both poll):
            # give it a few poll periods to start before the child is sent to the next source.
            deadline = time.monotonic() + min(wait_s, PLAN_GRACE_S)
            while not self.cache.knows(digest) and time.monotonic() < deadline:
                time.sleep(0.005)
        return self.cache.get(digest, wait_s=wait_s)


class Puller:
    def __init__(
        self,
        loader: WeightLoader,
        cfg: TetherConfig,
        *,
        delivery: Delivery,
        fleet: PeerDirectory,
        server_id: str,
        peer_host: str = "127.0.0.1",
        advertise_host: str | None = None,
        inflight: Literal["keep", "drain"] | None = None,
    ) -> None:
        self.loader, self.cfg, self.delivery, self.fleet = loader, cfg, delivery, fleet
        self.wcfg = cfg.weight_sync
        self.transport = cfg.weight_sync.transport
        assert self.transport.pulled, "the puller serves a pulled transport (store)"
        # Built first, so an unknown scheme stops the server here, before it serves its peers anything.
        self.mirrors: list[Source] = [mirror_source(url) for url in self.transport.mirrors]
        self.server_id = server_id
        self.inflight = inflight or self.wcfg.inflight
        self.held: Weights | None = None
        self.spare: Weights | None = None
        self.stats: dict[str, float] = {"pulls": 0, "pull_failures": 0, "load_failures": 0, "bytes": 0,
                                        "corrupt_chunks": 0, "source_failures": 0}  # fmt: skip
        self.mixed = False
        """A load failed half-way and nothing whole could be loaded back: the engine is paused until one does."""
        self.bytes_by_kind: dict[str, int] = {}
        self.last: FetchStats | None = None
        self.chunks = HeldChunks(cache_bytes=256 * 2**20)
        from tether.auth import auth_token
        from weight_sync.chunk_service import serve

        self.token = auth_token(cfg.rollout.auth_token) or None
        self.service = serve(self.chunks, host=peer_host, port=0, token=self.token)
        self._advertise = advertise_host
        self._remote: dict[str, Source] = {}

    @property
    def peer_address(self) -> str:
        """Where peers reach this server's chunk service (``advertise_host``: when it binds every interface)."""
        return f"{self._advertise}:{self.service.port}" if self._advertise else self.service.address

    async def join(self) -> None:
        """Enter the fan-out tree before the first pull (record the chunk service, holding nothing yet), so
        the fleet's tree is the same from the first version on."""
        await self.fleet.record(self.held.version if self.held is not None else -1, self.peer_address)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll the announcement and pull each new version until ``stop``."""
        backoff = self.transport.poll_s
        while not stop.is_set():
            try:
                announced = await self.fleet.announced()
                if announced is not None and (self.held is None or int(announced["version"]) != self.held.version):
                    await self.pull(announced)
                backoff = self.transport.poll_s
            except Exception as e:  # the weights held stay; the next poll tries again
                self.stats["pull_failures"] += 1
                log.warning("weight_pull_failed", error=str(e), retry_in_s=round(backoff, 3))
                backoff = min(1.0, max(backoff * 2, 0.05))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=backoff)

    def _source(self, address: str, kind: str) -> Source:
        key = f"{kind}:{address}"
        if key not in self._remote:
            from weight_sync.chunk_service import RemoteSource

            self._remote[key] = RemoteSource(address, kind=kind, token=self.token)
        return self._remote[key]

    def sources(self, version: int, origin: str, members: Sequence[Member]) -> list[Source]:
        """Where to fetch ``version`` from, in order: the store if mounted, my parent in the tree, a peer that
        holds it already, the mirrors, the relays, the origin."""
        out: list[Source] = []
        if self.transport.shared:
            out.append(ProviderSource(DirSource(store_root(self.cfg))))
        ids = sorted(m.server_id for m in members if m.peer)
        by_id = {m.server_id: m for m in members}
        if self.server_id in ids:
            parent = tree_parent(ids.index(self.server_id), self.transport.fanout)
            if parent is not None:
                out.append(self._source(by_id[ids[parent]].peer, "peer"))
        holders = [m for m in members if m.version == version and m.peer and m.server_id != self.server_id]
        if holders and self.transport.fanout > 0:
            out.append(self._source(random.choice(holders).peer, "peer"))
        out.extend(self.mirrors)
        out.extend(self._source(r, "relay") for r in self.transport.relays)
        if origin:
            out.append(self._source(origin, "origin"))
        return out

    async def pull(self, announced: dict) -> None:
        version = int(announced["version"])
        members = await self.fleet.members()
        sources = self.sources(version, str(announced.get("origin", "")), members)
        cache, expected = self.chunks.cache, []

        def expect(chain: list[Manifest]) -> None:  # peers asking for these wait for them rather than hear "no"
            expected.extend(c.hash for m in chain for c in m.chunks if cache.expect(c.hash))

        fetcher = Fetcher(sources, chunk_timeout_s=self.transport.chunk_timeout_s, on_chunk=cache.put, on_plan=expect)
        start = time.perf_counter()
        try:
            with spans.span("weight_fetch", version=version, sources=len(sources)):
                weights, stats = await asyncio.to_thread(fetcher.fetch, version, held=self.held, reuse=self.spare)
        finally:
            for digest in expected:  # what this fetch never got: its waiters hear "not held" now
                if digest not in cache:
                    cache.fail(digest)
        fetched = time.perf_counter()
        with spans.span("weight_swap", version=version):
            await self._swap(weights, stats.manifests[-1] if stats.manifests else None)
        swapped = time.perf_counter()
        self.last = stats
        self.stats["pulls"] += 1
        self.stats["bytes"] += stats.bytes
        self.stats["corrupt_chunks"] += stats.corrupt
        self.stats["source_failures"] += len(stats.failed_sources)
        for name, n in stats.bytes_by_source.items():
            kind = name.split(":", 1)[0]
            self.bytes_by_kind[kind] = self.bytes_by_kind.get(kind, 0) + n
        log.info("weights_pulled", version=version, chain=list(stats.chain), bytes=stats.bytes,
                 by_source=stats.bytes_by_source, corrupt=stats.corrupt, failed=sorted(stats.failed_sources),
                 fetch_s=round(fetched - start, 4), swap_s=round(swapped - fetched, 4))  # fmt: skip
        await self.fleet.record(version, self.peer_address)

    async def _swap(self, weights: Weights, manifest: Manifest | None) -> None:
        if weights is self.held:
            return
        if not self.mixed:  # after a load that failed half-way the engine is still paused
            await self.loader.pause(self.inflight)
        try:
            # Kept or copied, the rotation is the same: the old buffer is free once the new one is served.
            await self.delivery.load_pulled(weights, on_kept=lambda: None)
        except Exception as e:
            # Some tensors may be the new version's and some the old's: never serve that under either tag.
            self.stats["load_failures"] += 1
            self.mixed = not await self._restore_held()
            log.error("weight_pull_load_failed", version=weights.version, error=str(e),
                      serving=None if self.mixed else self.loader.policy_version, paused=self.mixed)  # fmt: skip
            if not self.mixed:
                await self.loader.resume()
            raise
        self.loader.policy_version = weights.version
        self.mixed = False
        await self.loader.resume()
        old, self.held = self.held, weights
        # The engine serves the new buffer (kept) or its own copy: either way the old one is free now.
        self.spare = old
        if manifest is not None:
            self.chunks.hold(weights, manifest)

    async def _restore_held(self) -> bool:
        """Load the version this server held whole again after a failed load; False when it holds none (the
        first pull: its weights came from the model folder) or that load fails too — the engine then stays
        paused until a pull loads whole (the next poll retries), rather than generate from mixed weights."""
        if self.held is None:
            return False
        try:
            await self.delivery.load_pulled(self.held, on_kept=lambda: None)
        except Exception as e:
            log.error("weight_restore_failed", version=self.held.version, error=str(e))
            return False
        return True

    def close(self) -> None:
        self.service.stop(0)
        for source in [*self._remote.values(), *self.mirrors]:
            close = getattr(source, "close", None)
            if close is not None:
                close()
