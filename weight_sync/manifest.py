"""The manifest of one published weight version: what it holds and how to rebuild it, as JSON.

A version is one flat buffer in the publish dtype (``bfloat16`` as GPU fleets run, ``float32`` on the
CPU default): every tensor is a run of it (``offset`` elements in, ``shape``), in the order the learner
gave them. The buffer is cut into chunks of a fixed size, regardless of tensor boundaries (so norms and
biases share a chunk instead of each costing a file, and a bad chunk costs one refetch of at most
``chunk_bytes``). Each chunk records how it is encoded (:mod:`weight_sync.delta`), the size and hash
of its stored bytes (which is also its file name in the store: content-addressed), and the hash of the
bits it decodes to, so a reader checks both what it fetched and what it rebuilt — a delta applied to
weights that are not really the version it is against fails that second check.

``base_version`` is ``None`` for a base (every chunk ``full``), else the version this one is a delta
against (always the one before it). The manifest is JSON, not pickle and not protobuf: it stays
readable with ``cat``, is a few hundred bytes per chunk (kilobytes for a model, against megabytes of
chunks), and no other process speaks it yet. :func:`Manifest.from_json` checks every field and names
the first one that is wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import xxhash

from weight_sync.delta import BITS, ENCODINGS

FORMAT = "tether-weights/1"
# xxh3_128 over blake2b: on this project's CPU (2 cores, 8 MiB buffers) xxh3_128 hashed at ~13.6 GB/s
# (median of 5) against ~0.77 GB/s for blake2b (sha256 ~0.71): the hash must not be what limits a
# decode that runs at ~1 GB/s. It guards against damage and mix-ups, not against an attacker who can
# write the store (who could rewrite the manifest too).
HASH = "xxh3_128"


def content_hash(data: bytes | memoryview) -> str:
    """The hash a manifest records (hex ``xxh3_128``) of ``data`` (anything with the buffer protocol)."""
    return xxhash.xxh3_128_hexdigest(data)


class WeightVersionError(RuntimeError):
    """A version cannot be read as asked (missing, corrupt, or against weights the reader lacks)."""


class ManifestError(WeightVersionError):
    """A manifest file that does not parse or does not add up."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    """Elements into the version's flat buffer."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ChunkEntry:
    start: int
    """First element of the flat buffer this chunk holds."""
    count: int
    encoding: str
    size: int
    """Bytes stored (what a reader fetches)."""
    hash: str
    """Hash of the stored bytes; also the chunk's file name."""
    raw_hash: str
    """Hash of the decoded bit patterns (``count`` elements of the publish dtype)."""


@dataclass(frozen=True)
class Manifest:
    version: int
    base_version: int | None
    dtype: str
    chunk_bytes: int
    tensors: tuple[TensorEntry, ...]
    chunks: tuple[ChunkEntry, ...]
    created: float = 0.0
    format: str = FORMAT
    hash: str = HASH

    @property
    def is_base(self) -> bool:
        return self.base_version is None

    @property
    def kind(self) -> str:
        return "base" if self.is_base else "delta"

    @property
    def num_elements(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def stored_bytes(self) -> int:
        """Bytes of chunks a reader fetches for this manifest (the manifest itself not included)."""
        return sum(c.size for c in self.chunks)

    def layout(self) -> tuple[tuple[str, tuple[int, ...], str, int], ...]:
        """What must match between a delta and the version it is applied to."""
        return tuple((t.name, t.shape, t.dtype, t.offset) for t in self.tensors)

    def to_json(self) -> bytes:
        d = asdict(self)
        d["tensors"] = [{**t, "shape": list(t["shape"])} for t in d["tensors"]]
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, where: str = "manifest") -> Manifest:
        try:
            d = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"{where}: not JSON ({e})") from None
        try:
            return _parse(d)
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"{where}: {e}") from None


def _int(d: dict[str, Any], key: str, *, low: int = 0) -> int:
    v = d[key]
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ValueError(f"{key} must be an integer >= {low}, not {v!r}")
    return v


def _str(d: dict[str, Any], key: str) -> str:
    v = d[key]
    if not isinstance(v, str) or not v:
        raise ValueError(f"{key} must be a non-empty string, not {v!r}")
    return v


def _parse(d: Any) -> Manifest:
    if not isinstance(d, dict):
        raise TypeError("top level must be an object")
    if d.get("format") != FORMAT:
        raise ValueError(f"format is {d.get('format')!r}; this reader knows {FORMAT!r}")
    if d.get("hash") != HASH:
        raise ValueError(f"hash is {d.get('hash')!r}; this reader knows {HASH!r}")
    dtype = _str(d, "dtype")
    if dtype not in BITS:
        raise ValueError(f"dtype {dtype!r} is not a publish dtype ({sorted(BITS)})")
    base = d["base_version"]
    if base is not None and (not isinstance(base, int) or base < 0 or base >= d["version"]):
        raise ValueError(f"base_version must be null or an earlier version, not {base!r}")
    tensors = []
    for k, t in enumerate(d["tensors"]):
        shape = t["shape"]
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise ValueError(f"tensors[{k}].shape must be a list of sizes, not {shape!r}")
        entry = TensorEntry(_str(t, "name"), tuple(shape), _str(t, "dtype"), _int(t, "offset"))
        if entry.dtype != dtype:
            raise ValueError(f"tensor {entry.name} has dtype {entry.dtype}, the manifest {dtype}")
        tensors.append(entry)
    chunks = []
    for k, c in enumerate(d["chunks"]):
        entry = ChunkEntry(_int(c, "start"), _int(c, "count", low=1), _str(c, "encoding"), _int(c, "size"),
                           _str(c, "hash"), _str(c, "raw_hash"))  # fmt: skip
        if entry.encoding not in ENCODINGS:
            raise ValueError(f"chunks[{k}].encoding {entry.encoding!r} is not one of {ENCODINGS}")
        if base is None and entry.encoding != "full":
            raise ValueError(f"chunks[{k}] is {entry.encoding} in a base version (a base is all full chunks)")
        chunks.append(entry)
    m = Manifest(version=_int(d, "version"), base_version=base, dtype=dtype, chunk_bytes=_int(d, "chunk_bytes", low=1),
                 tensors=tuple(tensors), chunks=tuple(chunks), created=float(d.get("created", 0.0)))  # fmt: skip
    _check_coverage(m)
    return m


def _check_coverage(m: Manifest) -> None:
    """Tensors tile the flat buffer in order and chunks cover it exactly once, in order."""
    at = 0
    for t in m.tensors:
        if t.offset != at:
            raise ValueError(f"tensor {t.name} starts at element {t.offset}, expected {at}")
        at += t.numel
    at = 0
    for k, c in enumerate(m.chunks):
        if c.start != at:
            raise ValueError(f"chunks[{k}] starts at element {c.start}, expected {at}")
        at += c.count
    if at != m.num_elements:
        raise ValueError(f"chunks cover {at} elements, the tensors hold {m.num_elements}")
