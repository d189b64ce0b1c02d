"""Weights as versions, in memory: flatten named tensors, encode a version, verify and decode one.

:class:`Weights` is what a reader holds: one flat buffer of bit patterns in the publish dtype
(tensors are views into it, so an engine can adopt them without a copy) and the version it is.
:func:`encode_version` turns weights (and the previous version's, for a delta) into a manifest plus its
chunks' stored bytes; :func:`decode_version` is the reverse and the only way back, and it trusts
nothing: every chunk's stored bytes are hashed before they are decoded, every decoded chunk is hashed
against what the learner published, a delta is refused unless the reader holds exactly the version it
is against with the same layout, and nothing is returned unless every chunk passed. Disk and network
are :mod:`weight_sync.store`'s; these functions take a callable that reads one chunk.

Both work chunk by chunk on a small pool of threads (``threads``, default ``min(4, cpus)``): zstd, xxh3
and numpy's ufuncs release the GIL, and chunks are independent. Each worker has its own
:class:`~weight_sync.delta.Codec` (zstd contexts and scratch arrays), the result is in chunk order
whatever the threads, and ``threads=1`` runs everything on the calling thread with the caller's codec.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from weight_sync.delta import ENCODINGS, Codec, Encoding, bits_dtype, decode_chunk, encode_chunk, from_bits
from weight_sync.manifest import ChunkEntry, Manifest, TensorEntry, WeightVersionError, content_hash

DEFAULT_CHUNK_BYTES = 4 * 2**20
MAX_DEFAULT_THREADS = 4
Named = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""Named full tensors, in the order they are laid out."""


class ChunkCorrupt(WeightVersionError):
    """A chunk's stored bytes, or what they decode to, do not hash to what its manifest says."""


class ChunkMissing(WeightVersionError):
    """A chunk a manifest names is not in the store (pruned while being read, or never written)."""


class NotHeld(WeightVersionError):
    """A delta against weights the reader does not hold (another version, or another layout)."""


@dataclass(eq=False)
class Weights:
    """One version's weights: ``bits`` (flat, the publish dtype's bit patterns) and where each tensor is."""

    version: int
    dtype: str
    entries: tuple[TensorEntry, ...]
    bits: np.ndarray
    fetched_bytes: int = 0
    """Chunk bytes read to build these weights from what the reader held (0 when not fetched)."""

    def flat(self) -> torch.Tensor:
        return from_bits(self.bits, self.dtype)

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """Each tensor as a view into :meth:`flat` (no copy)."""
        flat = self.flat()
        return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in self.entries}

    def layout(self) -> tuple[tuple[str, tuple[int, ...], str, int], ...]:
        return tuple((e.name, e.shape, e.dtype, e.offset) for e in self.entries)


def flatten(
    named: Named,
    *,
    version: int,
    dtype: str,
    reuse: Weights | None = None,
) -> Weights:
    """Cast ``named`` tensors (any float dtype, any device; full tensors, not shards) into one flat buffer.

    ``reuse``: a :class:`Weights` of the same layout whose buffer may be overwritten (the publisher's
    spare: a fresh buffer of model size costs a page fault per page on first touch)."""
    items = list(named.items() if isinstance(named, Mapping) else named)
    entries, at = [], 0
    for name, t in items:
        entries.append(TensorEntry(name, tuple(t.shape), dtype, at))
        at += t.numel()
    layout = tuple((e.name, e.shape, e.dtype, e.offset) for e in entries)
    bits = reuse.bits if reuse is not None and reuse.layout() == layout else np.empty(at, dtype=bits_dtype(dtype))
    flat = from_bits(bits, dtype)
    with torch.no_grad():
        for e, (_, t) in zip(entries, items, strict=True):
            flat[e.offset : e.offset + e.numel].view(e.shape).copy_(t.detach())  # casts on the way
    return Weights(version=version, dtype=dtype, entries=tuple(entries), bits=bits)


def default_threads() -> int:
    """The pool size when ``threads`` is ``None``: ``min(4, os.cpu_count())``."""
    return max(1, min(MAX_DEFAULT_THREADS, os.cpu_count() or 1))


class _Workers:
    """Run one function per chunk on the calling thread (``threads`` 1) or a pool, each with its own codec."""

    def __init__(self, threads: int | None, chunks: int, codec: Codec) -> None:
        threads = default_threads() if threads is None else threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1 (or None for min(4, cpus)), not {threads!r}")
        self.threads = max(1, min(threads, chunks))
        self._codec, self._level = codec, codec.level
        self._local = threading.local()
        self.pool: ThreadPoolExecutor | None = None

    def codec(self) -> Codec:
        """The codec of the thread that asks: the caller's when not pooled, else one per worker thread."""
        if self.pool is None:
            return self._codec
        codec = getattr(self._local, "codec", None)
        if codec is None:
            codec = self._local.codec = Codec(self._level)
        return codec

    @contextmanager
    def running(self) -> Iterator[_Workers]:
        if self.threads == 1:
            yield self
            return
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="weight-chunks")
        try:
            yield self
        finally:  # on an error too: wait for the workers (they write into the caller's buffer), start no more
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def encode_version(
    weights: Weights,
    prev: Weights | None,
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    codec: Codec | None = None,
    allow: tuple[Encoding, ...] = ENCODINGS,
    threads: int | None = None,
) -> tuple[Manifest, dict[str, bytes | memoryview]]:
    """The manifest of ``weights`` and its chunks' stored bytes by hash.

    ``prev`` ``None``: a base (every chunk ``full``). Otherwise a delta against ``prev``, which must be the
    version right before with the same layout; each chunk takes the smallest of ``allow``. ``threads``:
    chunks encoded at once (``None``: ``min(4, cpus)``); the manifest is the same for any number."""
    codec = codec or Codec()
    if prev is not None:
        if prev.version != weights.version - 1:
            raise ValueError(f"v{weights.version}: a delta is against the version before (v{weights.version - 1}), "
                             f"not v{prev.version}")  # fmt: skip
        if prev.layout() != weights.layout():
            raise ValueError(f"v{weights.version}: the layout changed since v{prev.version}; publish a base")
    step = max(1, chunk_bytes // weights.bits.dtype.itemsize)
    starts = range(0, weights.bits.size, step)
    workers = _Workers(threads, len(starts), codec)

    def one(start: int) -> tuple[ChunkEntry, bytes | memoryview]:
        new = weights.bits[start : start + step]
        old = None if prev is None else prev.bits[start : start + step]
        encoding, payload = encode_chunk(new, old, workers.codec(), allow=allow)
        h = content_hash(payload)
        raw = h if encoding == "full" else content_hash(new)
        return ChunkEntry(start, new.size, encoding, len(payload), h, raw), payload

    with workers.running():
        done = list(map(one, starts) if workers.pool is None else workers.pool.map(one, starts))  # in order
    chunks = [entry for entry, _ in done]
    payloads = {entry.hash: payload for entry, payload in done}
    manifest = Manifest(version=weights.version, base_version=None if prev is None else prev.version,
                        dtype=weights.dtype, chunk_bytes=chunk_bytes, tensors=weights.entries,
                        chunks=tuple(chunks), created=time.time())  # fmt: skip
    return manifest, payloads


def tensors_in(manifest: Manifest, chunk: ChunkEntry, limit: int = 3) -> str:
    """The names of the tensors a chunk overlaps (for error messages)."""
    stop = chunk.start + chunk.count
    names = [t.name for t in manifest.tensors if t.offset < stop and t.offset + t.numel > chunk.start]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def describe(manifest: Manifest, k: int) -> str:
    c = manifest.chunks[k]
    return (f"v{manifest.version} ({manifest.kind}) chunk {k} of {len(manifest.chunks)} (elements {c.start}.."
            f"{c.start + c.count}, {tensors_in(manifest, c)}; stored as {c.hash})")  # fmt: skip


def decode_version(
    manifest: Manifest,
    read_chunk: Callable[[int], bytes | memoryview],
    held: Weights | None,
    *,
    codec: Codec | None = None,
    in_place: bool = False,
    reuse: Weights | None = None,
    threads: int | None = None,
) -> Weights:
    """Rebuild ``manifest``'s version. ``read_chunk(k)`` returns chunk k's stored bytes, already hash-checked
    (the store re-reads a bad chunk); they are checked again here, so no caller can skip it.

    ``held``: the weights a delta applies to, which must be exactly ``manifest.base_version`` with the same
    layout (ignored for a base). ``in_place``: overwrite ``held``'s buffer (only for weights nobody else
    uses: a chain's intermediate). ``reuse``: weights the caller no longer needs, whose buffer receives the
    result when the size fits (a receiver's second set: a fresh model-sized buffer costs a page fault per
    page on first touch, measured at several times the decode itself). On any error nothing is returned,
    and ``held`` is untouched unless ``in_place`` (``reuse``'s buffer may be half written).

    ``threads``: chunks verified and decoded at once (``None``: ``min(4, cpus)``). ``read_chunk`` is still
    called on the calling thread, in chunk order, at most ``2 * threads`` chunks ahead of the decoding; the
    error raised is the one of the first bad chunk in order, as with one thread, and no worker is still
    writing when this returns or raises."""
    codec = codec or Codec()
    dtype = bits_dtype(manifest.dtype)
    if manifest.base_version is not None:
        _check_held(manifest, held)
    out = _output_buffer(manifest, held, dtype, in_place=in_place, reuse=reuse)
    workers = _Workers(threads, len(manifest.chunks), codec)

    def one(k: int, payload: bytes | memoryview) -> None:
        c = manifest.chunks[k]
        if content_hash(payload) != c.hash:
            raise ChunkCorrupt(f"{describe(manifest, k)}: the stored bytes do not match their hash")
        old = None if manifest.base_version is None else held.bits[c.start : c.start + c.count]
        dest = out[c.start : c.start + c.count]
        try:
            decode_chunk(c.encoding, payload, old, count=c.count, dtype=dtype, codec=workers.codec(), out=dest)
        except ValueError as e:  # a frame that passed its hash but does not decode: written wrongly
            raise ChunkCorrupt(f"{describe(manifest, k)}: {e}") from None
        if content_hash(dest) != c.raw_hash:
            why = (
                "the stored bytes decode to other bits than were published"
                if old is None
                else f"decoded against the v{manifest.base_version} this reader holds, the bits differ from the "
                f"published ones: the held weights are not the published v{manifest.base_version}; fetch a base"
            )
            raise ChunkCorrupt(f"{describe(manifest, k)}: {why}")  # fmt: skip

    with workers.running():
        fetched = _read_and_decode(len(manifest.chunks), read_chunk, one, workers)
    return Weights(version=manifest.version, dtype=manifest.dtype, entries=manifest.tensors, bits=out,
                   fetched_bytes=fetched)  # fmt: skip


def _check_held(manifest: Manifest, held: Weights | None) -> None:
    """A delta applies only to exactly its base version with the same layout and dtype."""
    if held is None or held.version != manifest.base_version:
        have = "no weights" if held is None else f"v{held.version}"
        raise NotHeld(f"v{manifest.version} is a delta against v{manifest.base_version}, and this reader holds "
                      f"{have}: fetch it through the store (it plans a base and the deltas after it)")  # fmt: skip
    if held.dtype != manifest.dtype or held.layout() != manifest.layout():
        raise NotHeld(f"v{manifest.version} is a delta against v{manifest.base_version} with another layout "
                      f"or dtype than the v{held.version} this reader holds: fetch a base")  # fmt: skip


def _output_buffer(
    manifest: Manifest, held: Weights | None, dtype: np.dtype, *, in_place: bool, reuse: Weights | None
) -> np.ndarray:
    """Where the decoded version goes: ``held``'s buffer (a delta ``in_place``), else ``reuse``'s when it
    fits (never one ``held`` shares), else a new one."""
    out = held.bits if in_place and held is not None and manifest.base_version is not None else None
    if out is None and reuse is not None and reuse.bits.size == manifest.num_elements and reuse.bits.dtype == dtype:
        if held is not None and np.may_share_memory(reuse.bits, held.bits):
            raise ValueError(f"v{manifest.version}: reuse shares memory with the held v{held.version}")
        out = reuse.bits
    if out is None:
        out = np.empty(manifest.num_elements, dtype=dtype)
    return out


def _read_and_decode(
    count: int,
    read_chunk: Callable[[int], bytes | memoryview],
    one: Callable[[int, bytes | memoryview], None],
    workers: _Workers,
) -> int:
    """Read chunks 0..count-1 in order on this thread and hand each to ``one`` (on the workers' pool, at most
    ``2 * threads`` ahead); the bytes read. The first bad chunk in order is the error raised."""
    fetched = 0
    pending: deque[Future[None]] = deque()  # in chunk order
    for k in range(count):
        try:
            payload = read_chunk(k)
        except BaseException:
            for f in pending:  # a bad chunk before this one is the error to report, as with one thread
                f.result()
            raise
        fetched += len(payload)
        if workers.pool is None:
            one(k, payload)
            continue
        pending.append(workers.pool.submit(one, k, payload))
        while len(pending) > 2 * workers.threads or (pending and pending[0].done()):
            pending.popleft().result()  # the oldest first: its error comes before any later chunk's
    while pending:
        pending.popleft().result()
    return fetched
