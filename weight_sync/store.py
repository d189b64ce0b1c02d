"""A directory of published weight versions: content-addressed chunks, manifests written last.

    root/
      chunks/3f/3f9a…e1          one file per distinct chunk, named by the xxh3_128 of its stored bytes
      manifests/v00000020.base.json
      manifests/v00000020.delta.json   (the same version as a delta against v19, for readers at v19)
      manifests/v00000021.delta.json

The learner publishes each version once (:class:`VersionWriter`): a base every ``base_every`` versions (and
whenever it has no previous version to diff against), a delta against the previous version otherwise —
and at a base version a delta as well, so a reader that keeps up never downloads a base. Every file is
written under a temporary name and renamed into place, chunks first and the manifest last, so a reader
that sees a manifest finds all its chunks (unless a prune removed them since: :class:`ChunkMissing`).

A reader (:meth:`VersionStore.fetch`) names the version it wants and the weights it holds; the store
plans the fewest bytes — the deltas after the reader's version, or the newest base not after the target
plus the deltas after it — and decodes with every hash checked (:func:`weight_sync.versions.decode_version`).
A chunk whose bytes fail their hash is read once more (a torn read on a network filesystem) before the
fetch fails with an error naming the version, chunk and tensors.

One writer per store: :meth:`VersionStore.prune` deletes chunks no manifest names, which would race with a
second publisher's chunks that are not yet named.
"""

from __future__ import annotations

import os
import re
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from weight_sync.delta import Codec, bits_dtype
from weight_sync.manifest import Manifest, WeightVersionError, content_hash
from weight_sync.versions import (
    DEFAULT_CHUNK_BYTES,
    ChunkCorrupt,
    ChunkMissing,
    Named,
    Weights,
    decode_version,
    describe,
    encode_version,
    flatten,
)

_MANIFEST = re.compile(r"^v(\d{8,})\.(base|delta)\.json$")
KINDS = ("base", "delta")


class VersionMissing(WeightVersionError):
    """The store has no manifest for the version asked for."""


def manifest_name(version: int, kind: str) -> str:
    """Where a manifest lies, relative to the store's root (the layout every copy of a store serves)."""
    return f"manifests/v{version:08d}.{kind}.json"


def chunk_name(digest: str) -> str:
    """Where a chunk lies, relative to the store's root."""
    return f"chunks/{digest[:2]}/{digest}"


def plan_chain(
    version: int,
    held: int | None,
    *,
    kinds: Callable[[int], Collection[str]],
    manifest: Callable[[int, str], Manifest],
    where: str,
) -> list[Manifest]:
    """The manifests to apply, in order, to go from ``held`` (``None``: nothing) to ``version``: the deltas
    from ``held`` on, or a base and the deltas after it, whichever stores fewer bytes. Over any copy of the
    layout: ``kinds(k)`` names the manifests version ``k`` has (empty: none), ``manifest(k, kind)`` reads
    one; ``where`` names the copy in errors."""
    if not kinds(version):
        raise VersionMissing(f"{where}: v{version} is not published")
    if held == version:
        return []
    best: tuple[int, list[Manifest]] | None = None
    deltas: list[Manifest] = []
    cost, k = 0, version
    while k >= 0 and (have := kinds(k)):
        if k == held:
            if best is None or cost < best[0]:
                best = (cost, deltas[::-1])
            break
        if "base" in have:
            base = manifest(k, "base")
            if best is None or cost + base.stored_bytes < best[0]:
                best = (cost + base.stored_bytes, [base, *deltas[::-1]])
        if "delta" not in have or (best is not None and cost >= best[0]):
            break
        m = manifest(k, "delta")
        deltas.append(m)
        cost += m.stored_bytes
        k = m.base_version
    if best is None:
        raise VersionMissing(
            f"{where}: v{version} cannot be rebuilt: no base before it with an unbroken "
            f"chain of deltas{'' if held is None else f', nor a chain from the held v{held}'}"
        )
    return best[1]


class VersionStore:
    """Publish into and fetch from one directory (a local disk, or a filesystem every server mounts)."""

    def __init__(self, root: str | Path, *, fsync: bool = True, codec: Codec | None = None) -> None:
        self.root = Path(root)
        self.chunks_dir = self.root / "chunks"
        self.manifests_dir = self.root / "manifests"
        self.fsync = fsync
        self.codec = codec or Codec()

    # -- layout ------------------------------------------------------------------------------------------
    def manifest_path(self, version: int, kind: str) -> Path:
        return self.root / manifest_name(version, kind)

    def chunk_path(self, digest: str) -> Path:
        return self.root / chunk_name(digest)

    def _listing(self) -> dict[int, set[str]]:
        out: dict[int, set[str]] = {}
        if self.manifests_dir.is_dir():
            for p in self.manifests_dir.iterdir():
                m = _MANIFEST.match(p.name)
                if m:
                    out.setdefault(int(m.group(1)), set()).add(m.group(2))
        return out

    def versions(self) -> list[int]:
        """Versions with a manifest (a version whose manifest was never renamed into place is not one)."""
        return sorted(self._listing())

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def kinds(self, version: int) -> set[str]:
        return set(self._listing().get(version, ()))

    def manifest(self, version: int, kind: str) -> Manifest:
        path = self.manifest_path(version, kind)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            have = self.versions()
            span = f"v{have[0]}..v{have[-1]}" if have else "none"
            raise VersionMissing(f"{self.root}: no {kind} manifest of v{version} (versions held: {span})") from None
        m = Manifest.from_json(data, where=str(path))
        if m.version != version or m.kind != kind:
            raise WeightVersionError(f"{path} holds v{m.version} ({m.kind}), not v{version} ({kind})")
        return m

    # -- writing -----------------------------------------------------------------------------------------
    def _write_file(self, path: Path, data: Iterable[bytes | memoryview]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:8]}"
        with tmp.open("wb") as f:
            for part in data:
                f.write(part)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def _write_chunk(self, digest: str, payload: bytes | memoryview) -> int:
        path = self.chunk_path(digest)
        if path.exists():  # content-addressed: the same name is the same bytes
            return 0
        self._write_file(path, [payload])
        return len(payload)

    def _write_manifest(self, manifest: Manifest) -> None:
        self._write_file(self.manifest_path(manifest.version, manifest.kind), [manifest.to_json()])

    def write(self, manifest: Manifest, payloads: Mapping[str, bytes | memoryview]) -> int:
        """Store one manifest: its chunks first, then the manifest. Returns the chunk bytes newly written."""
        missing = {c.hash for c in manifest.chunks} - set(payloads)
        if missing:
            raise ValueError(f"v{manifest.version}: {len(missing)} chunks named by the manifest have no payload")
        if self.manifest_path(manifest.version, manifest.kind).exists():
            raise WeightVersionError(f"{self.root}: v{manifest.version} ({manifest.kind}) is already published; "
                                     "a version is published once")  # fmt: skip
        written = sum(self._write_chunk(c.hash, payloads[c.hash]) for c in manifest.chunks)
        self._write_manifest(manifest)
        return written

    # -- reading -----------------------------------------------------------------------------------------
    def _reader(self, manifest: Manifest, *, retries: int):
        def read(k: int) -> bytes:
            c = manifest.chunks[k]
            for _ in range(retries + 1):
                try:
                    data = self.chunk_path(c.hash).read_bytes()
                except FileNotFoundError:
                    raise ChunkMissing(f"{describe(manifest, k)}: the chunk file is gone (pruned while this reader "
                                       "fetched?) — fetch the latest version again") from None  # fmt: skip
                if content_hash(data) == c.hash:
                    return data
            raise ChunkCorrupt(f"{describe(manifest, k)}: the stored bytes do not match their hash "
                               f"({retries + 1} reads of {self.chunk_path(c.hash)})")  # fmt: skip

        return read

    def plan(self, version: int, held: int | None = None) -> list[Manifest]:
        """The manifests to apply, in order, to go from ``held`` (``None``: nothing) to ``version``: the
        deltas from ``held`` on, or a base and the deltas after it, whichever stores fewer bytes."""
        listing = self._listing()
        if version not in listing:
            raise self._missing(version, listing)
        return plan_chain(version, held, kinds=lambda k: listing.get(k, set()), manifest=self.manifest,
                          where=str(self.root))  # fmt: skip

    def _missing(self, version: int, listing: dict[int, set[str]]) -> VersionMissing:
        have = sorted(listing)
        span = f"v{have[0]}..v{have[-1]}" if have else "none (no manifest written yet)"
        return VersionMissing(f"{self.root}: v{version} is not published (versions held: {span})")

    def fetch(
        self, version: int | None = None, *, held: Weights | None = None, reuse: Weights | None = None, retries: int = 1
    ) -> Weights:
        """Version ``version`` (``None``: the latest), rebuilt from ``held`` where that is cheaper, every chunk
        verified. ``held`` is never modified; the result is ``held`` itself when it is current, else it owns
        a new buffer, or ``reuse``'s (weights the caller is done with: a receiver's other set)."""
        if version is None:
            version = self.latest()
            if version is None:
                raise VersionMissing(f"{self.root}: no version published yet")
        chain = self.plan(version, None if held is None else held.version)
        if not chain and held is not None:
            return held
        current, fetched = held, 0
        for m in chain:
            own = current is not None and current is not held  # a chain's intermediate: decode in place
            current = decode_version(m, self._reader(m, retries=retries), current, codec=self.codec, in_place=own,
                                     reuse=None if own else reuse)  # fmt: skip
            fetched += current.fetched_bytes
        if current is None:
            raise VersionMissing(f"{self.root}: nothing to rebuild v{version} from")
        current.fetched_bytes = fetched
        return current

    def truncate(self, after: int) -> int:
        """Remove every manifest of a version after ``after`` (a resumed learner: versions published after
        its checkpoint belong to a timeline that is gone); chunks go at the next prune. Returns how many."""
        removed = 0
        for v, kinds in self._listing().items():
            if v > after:
                for kind in kinds:
                    self.manifest_path(v, kind).unlink(missing_ok=True)
                    removed += 1
        return removed

    # -- pruning -----------------------------------------------------------------------------------------
    def prune(self, keep: int) -> tuple[int, int]:
        """Keep the newest ``keep`` versions readable from nothing (their base and the deltas after it stay,
        however old) and the delta manifests of kept versions; delete every other manifest, then every
        chunk no remaining manifest names. Returns (manifests, chunk files) deleted."""
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        listing = self._listing()
        kept = sorted(listing)[-keep:]
        needed: set[tuple[int, str]] = set()
        for v in kept:
            try:
                needed.update((m.version, m.kind) for m in self.plan(v))
            except VersionMissing:  # not rebuildable from nothing (its base is gone): leave it as it is
                needed.update((v, kind) for kind in listing[v])
            if "delta" in listing[v]:
                needed.add((v, "delta"))
        removed = 0
        for v, kinds in listing.items():
            for kind in kinds - {k for (w, k) in needed if w == v}:
                self.manifest_path(v, kind).unlink(missing_ok=True)
                removed += 1
        names = {c.hash for v, kind in needed for c in self.manifest(v, kind).chunks}
        gone = 0
        if self.chunks_dir.is_dir():
            for sub in self.chunks_dir.iterdir():
                for p in sub.iterdir() if sub.is_dir() else ():
                    if p.name not in names:  # also a crashed writer's .tmp- file (one writer per store)
                        p.unlink(missing_ok=True)
                        gone += 1
        return removed, gone


@dataclass
class Published:
    """What one :meth:`VersionWriter.publish` did."""

    version: int
    kinds: tuple[str, ...]
    manifests: dict[str, Manifest]
    full_bytes: int
    """The version's bytes in the publish dtype (what a full push sends)."""
    encode_seconds: float
    write_seconds: float
    written_bytes: int

    @property
    def delta_bytes(self) -> int | None:
        m = self.manifests.get("delta")
        return None if m is None else m.stored_bytes


class VersionWriter:
    """The learner side: each :meth:`publish` turns named full tensors into version ``v`` in the store.

    Keeps the previous version's published bits (one model in the publish dtype) to diff against, and
    a spare buffer of the same size so that no publish allocates a model-sized buffer afresh."""

    def __init__(
        self,
        store: VersionStore,
        *,
        dtype: str = "bfloat16",
        base_every: int = 10,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        keep: int | None = None,
        delta_at_base: bool = True,
    ) -> None:
        bits_dtype(dtype)  # a clear error for an unsupported dtype, before any work
        if base_every < 1:
            raise ValueError(f"base_every must be at least 1, not {base_every}")
        self.store, self.dtype, self.base_every = store, dtype, base_every
        self.chunk_bytes, self.keep, self.delta_at_base = chunk_bytes, keep, delta_at_base
        self.prev: Weights | None = None
        self._spare: Weights | None = None

    def stage(self, version: int, named: Named) -> Weights:
        """Cast ``named`` (full tensors, in a fixed order) into the publish dtype: the only step that
        reads the model, so the caller may change the weights as soon as it returns (:meth:`commit` the
        result, possibly on another thread)."""
        spare, self._spare = self._spare, None
        return flatten(named, version=version, dtype=self.dtype, reuse=spare)

    def publish(self, version: int, named: Named) -> Published:
        """Publish ``named`` (full tensors, in a fixed order) as ``version``; see the class docstring."""
        return self.commit(self.stage(version, named))

    def commit(self, weights: Weights, *, base: bool = False) -> Published:
        """Encode and write staged ``weights``; ``base``: start afresh — a base only, diffed against nothing
        (a resumed learner's first publication)."""
        t0 = time.perf_counter()
        version = weights.version
        prev = None if base else self.prev
        can_delta = prev is not None and prev.version == version - 1 and prev.layout() == weights.layout()
        kinds = ["base"] if version % self.base_every == 0 or not can_delta else []
        if can_delta and (not kinds or self.delta_at_base):
            kinds.append("delta")
        encoded = {k: encode_version(weights, prev if k == "delta" else None, chunk_bytes=self.chunk_bytes,
                                     codec=self.store.codec) for k in kinds}  # fmt: skip
        t1 = time.perf_counter()
        written = sum(self.store.write(m, payloads) for m, payloads in encoded.values())
        if self.keep is not None:
            self.store.prune(self.keep)
        t2 = time.perf_counter()
        self._spare, self.prev = prev, weights
        return Published(version=version, kinds=tuple(kinds), manifests={k: m for k, (m, _) in encoded.items()},
                         full_bytes=weights.bits.nbytes, encode_seconds=t1 - t0, write_seconds=t2 - t1,
                         written_bytes=written)  # fmt: skip
