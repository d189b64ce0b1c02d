"""One chunk of a weight version, encoded the smallest way: ``full``, ``xor_zstd`` or ``sparse``.

A chunk is a run of elements of the version's flat buffer in the publish dtype, handled as raw bit
patterns (``bfloat16``/``float16`` as ``uint16``, ``float32`` as ``uint32``): XOR on bit patterns is
exact, so a delta round trip gives back the very bits the learner published, never a float that was
added and subtracted.

* ``full``: the bits as they are (a base, or a chunk whose delta would be no smaller).
* ``xor_zstd``: ``new ^ old``, its bytes split into planes (every element's byte 0, then every byte 1,
  ...), compressed with zstd. Between two learner steps most elements keep their bits (at lr 1e-6 in
  bf16, 95-98 %), so the XOR is mostly zero and what flipped are low mantissa bits: the plane of high
  bytes is almost all zeros and compresses to nearly nothing. On random bf16 weights (2 Mi elements,
  level 1) planes took the XOR from 18.7 % to 14.9 % of the raw bytes at 25 % changed and from 34 % to
  26 % at 75 %, and never made it larger.
* ``sparse``: the positions that changed (as gaps from the previous one, ``uint32``) and their XOR
  values, each in byte planes, in one zstd frame. Gaps are small numbers and the XOR values' high bytes
  are zero, so the planes compress well, and zstd no longer spends bits on the runs of zeros between
  changes. On the same random bf16 weights (2 Mi elements, level 1) it took 2.5 % of the raw bytes at
  4 % changed (``xor_zstd`` 4.4 %), 11 % at 25 % (15 %), 17 % at 40 % (19 %), and lost from about 60 %
  (24 % against 23 %; 34 % against 30 % at 87 %). Only clustered changes (a run of them, as when one
  tensor moves and its neighbours do not) let ``xor_zstd`` win below that: by 3.6 % of its bytes at 1 %
  changed in one run.

:func:`encode_chunk` computes the XOR and the number of changed elements once and tries only what can win
— ``sparse`` up to 60 % changed, ``xor_zstd`` from 25 % or when the changes are clustered — and keeps the
smallest; on every case measured that is the pick of trying all three, byte for byte. Skipping
``xor_zstd`` is most of the speed at small learning rates: at lr 1e-6 (2-3 % changed) its zstd pass over
the planes was 45 % of the encode time and its planes another 15 %, for a payload 1.8x sparse's.
:func:`decode_chunk` is the inverse. Both are pure functions of numpy arrays and bytes and write their
intermediates into the :class:`Codec`'s scratch arrays; hashing and storage are :mod:`weight_sync.store`'s.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import zstandard

Encoding = Literal["full", "xor_zstd", "sparse"]
ENCODINGS: tuple[Encoding, ...] = ("full", "xor_zstd", "sparse")

# Publication dtypes and the unsigned integer type their bit patterns are handled as.
BITS: dict[str, tuple[torch.dtype, torch.dtype, np.dtype]] = {
    "bfloat16": (torch.bfloat16, torch.int16, np.dtype("<u2")),
    "float16": (torch.float16, torch.int16, np.dtype("<u2")),
    "float32": (torch.float32, torch.int32, np.dtype("<u4")),
}

# Past this share of changed elements sparse was never the smaller (see above), so it is not tried.
SPARSE_MAX_SHARE = 0.6
# Up to this share sparse was always the smaller on spread changes (0.56-0.85 of xor_zstd's bytes on
# normal weights after Gaussian steps), so xor_zstd, the slower of the two there (zstd over every byte of
# the chunk), is not tried unless the changes are clustered (see encode_chunk).
XOR_MIN_SHARE = 0.25
_SPARSE_HEADER = np.dtype("<u8")


def bits_dtype(dtype: str) -> np.dtype:
    """The numpy unsigned type holding ``dtype``'s bit patterns; a clear error for an unsupported dtype."""
    try:
        return BITS[dtype][2]
    except KeyError:
        raise ValueError(f"publish dtype {dtype!r} is not supported; use one of {sorted(BITS)}") from None


def torch_dtype(dtype: str) -> torch.dtype:
    bits_dtype(dtype)
    return BITS[dtype][0]


def as_bits(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a contiguous CPU tensor as a numpy view (no copy): bf16 → uint16, fp32 → uint32."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in BITS:
        raise ValueError(f"cannot take the bit patterns of a {t.dtype} tensor; supported: {sorted(BITS)}")
    _, signed, unsigned = BITS[name]
    return t.detach().contiguous().view(signed).numpy().view(unsigned)


def from_bits(bits: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor of ``dtype`` sharing ``bits``' memory (the inverse of :func:`as_bits`)."""
    floating, _, unsigned = BITS[dtype]
    if bits.dtype != unsigned:
        raise ValueError(f"bits of dtype {bits.dtype} cannot hold {dtype} (needs {unsigned})")
    return torch.from_numpy(bits.view(f"<i{unsigned.itemsize}")).view(floating)


class Codec:
    """zstd contexts and scratch arrays, reused across chunks (building a context costs more than compressing
    a small chunk; a fresh chunk-sized array costs a page fault per page on first touch).

    Not safe to share between threads: one per thread (each store and publisher has its own; a threaded
    encode or decode gives each worker its own, at the caller's level)."""

    def __init__(self, level: int = 1) -> None:
        self.level = level
        self._c = zstandard.ZstdCompressor(level=level)
        self._d = zstandard.ZstdDecompressor()
        self._scratch: dict[str, np.ndarray] = {}

    def compress(self, data: bytes | memoryview | np.ndarray) -> bytes:
        return self._c.compress(data)

    def decompress(self, data: bytes, size: int) -> bytes:
        try:
            out = self._d.decompress(data, max_output_size=size)
        except zstandard.ZstdError as e:
            raise ValueError(f"not a zstd frame of {size} bytes ({e})") from None
        if len(out) != size:
            raise ValueError(f"zstd frame decompressed to {len(out)} bytes, expected {size}")
        return out

    def scratch(self, name: str, count: int, dtype: np.dtype | str | type) -> np.ndarray:
        """A reusable array of ``count`` elements of ``dtype`` under ``name`` (contents undefined; valid
        until the next call with the same ``name``). Never handed out of this module's functions."""
        dtype = np.dtype(dtype)
        nbytes = count * dtype.itemsize
        buf = self._scratch.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._scratch[name] = np.empty(max(nbytes, 1), dtype=np.uint8)
        return buf[:nbytes].view(dtype)


def encode_chunk(
    new: np.ndarray, old: np.ndarray | None, codec: Codec, *, allow: tuple[Encoding, ...] = ENCODINGS
) -> tuple[Encoding, bytes | memoryview]:
    """The smallest encoding of ``new`` (bit patterns) given ``old`` (same shape and type, or ``None``: full).

    ``allow`` narrows the choice (the tests pin one encoding to check each round trip). Of ``xor_zstd`` and
    ``sparse`` only those that can win are tried, from the share of changed elements and whether they are
    clustered (see the module docstring); on a tie the order of :data:`ENCODINGS` decides."""
    if old is None or allow == ("full",):
        return "full", memoryview(new).cast("B")
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"delta of a {new.dtype}[{new.size}] chunk against a {old.dtype}[{old.size}] one")
    flat_new, old = new.reshape(-1), old.reshape(-1)
    # The XOR and the changed mask once, into this thread's scratch: both encodings start from them.
    xor = np.bitwise_xor(flat_new, old, out=codec.scratch("xor", new.size, new.dtype))
    mask = np.not_equal(xor, 0, out=codec.scratch("mask", new.size, np.bool_))
    changed = int(np.count_nonzero(mask))
    sparse = xor_zstd = None
    clustered = False
    if "sparse" in allow and (allow == ("sparse",) or changed <= SPARSE_MAX_SHARE * new.size):
        raw, clustered = _sparse_raw(np.flatnonzero(mask), xor, codec)
        sparse = codec.compress(raw)
    if "xor_zstd" in allow and (sparse is None or clustered or changed > XOR_MIN_SHARE * new.size):
        planes = codec.scratch("planes", xor.nbytes, np.uint8).reshape(xor.dtype.itemsize, xor.size)
        xor_zstd = codec.compress(_planes(xor, planes, codec))
    best: tuple[Encoding, bytes | memoryview] | None = None
    for encoding, payload in (("full", memoryview(new).cast("B") if "full" in allow else None),
                              ("xor_zstd", xor_zstd), ("sparse", sparse)):  # fmt: skip
        if payload is not None and (best is None or len(payload) < len(best[1])):
            best = (encoding, payload)
    if best is None:
        raise ValueError(f"no encoding allowed among {allow}")
    return best


def _planes(bits: np.ndarray, out: np.ndarray, codec: Codec) -> np.ndarray:
    """Byte planes of ``bits`` written into ``out`` (uint8, (itemsize, n)): byte 0 of every element, then byte
    1, ... By shifts and narrowing copies: numpy's transposing copy of the (n, itemsize) byte grid was 2.5x
    slower this way and 8x slower the other (:func:`_unplanes`) on 2 Mi bf16 elements."""
    shifted = codec.scratch("shift", bits.size, bits.dtype)
    np.copyto(out[0], bits, casting="unsafe")  # keeps the low byte
    for k in range(1, bits.dtype.itemsize):
        np.copyto(out[k], np.right_shift(bits, 8 * k, out=shifted), casting="unsafe")
    return out


def _unplanes(planes: np.ndarray, out: np.ndarray, codec: Codec) -> np.ndarray:
    """The inverse of :func:`_planes`: ``planes`` (uint8, (itemsize, n)) into ``out`` (n elements)."""
    np.copyto(out, planes[0])
    shifted = codec.scratch("shift", out.size, out.dtype)
    for k in range(1, out.dtype.itemsize):
        np.copyto(shifted, planes[k])
        np.bitwise_or(out, np.left_shift(shifted, 8 * k, out=shifted), out=out)
    return out


def _sparse_raw(where: np.ndarray, xor: np.ndarray, codec: Codec) -> tuple[np.ndarray, bool]:
    """The uncompressed sparse frame (header, gap planes, value planes) in scratch, and whether the changes
    are clustered (most of them right after another), where ``xor_zstd`` can be the smaller after all."""
    n, isz = where.size, xor.dtype.itemsize
    head = _SPARSE_HEADER.itemsize
    raw = codec.scratch("raw", head + n * (4 + isz), np.uint8)
    raw[:head] = np.array([n], dtype=_SPARSE_HEADER).view(np.uint8)
    # Gaps, not positions: changes are spread evenly, so gaps are small numbers whose high bytes are zero.
    gaps = codec.scratch("gaps", n, "<u4")
    if n:
        gaps[0] = where[0]
        np.subtract(where[1:], where[:-1], out=gaps[1:], casting="unsafe")
    _planes(gaps, raw[head : head + 4 * n].reshape(4, n), codec)
    values = np.take(xor, where, out=codec.scratch("values", n, xor.dtype), mode="clip")  # "raise" buffers out
    _planes(values, raw[head + 4 * n :].reshape(isz, n), codec)
    clustered = n > 1 and np.count_nonzero(gaps[1:] == 1) > n // 2
    return raw, bool(clustered)


def decode_chunk(
    encoding: str,
    payload: bytes | memoryview,
    old: np.ndarray | None,
    *,
    count: int,
    dtype: np.dtype,
    codec: Codec,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The chunk's ``count`` bit patterns, written into ``out`` (a new array when ``None``).

    ``old``: the same chunk of the version this one is a delta against (``None`` for a full chunk); it is
    only written when the caller passes it as ``out`` too (decoding in place)."""
    if out is None:
        out = np.empty(count, dtype=dtype)
    elif out.size != count or out.dtype != dtype:
        raise ValueError(f"out holds {out.dtype}[{out.size}], the chunk {dtype}[{count}]")
    if encoding == "full":
        if len(payload) != count * dtype.itemsize:
            raise ValueError(f"full chunk holds {len(payload)} bytes, expected {count * dtype.itemsize}")
        out[:] = np.frombuffer(payload, dtype=dtype)
        return out
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown chunk encoding {encoding!r} (known: {', '.join(ENCODINGS)})")
    if old is None or old.size != count or old.dtype != dtype:
        raise ValueError(f"a {encoding} chunk needs the same {count} elements of the version it is a delta against")
    isz = dtype.itemsize
    if encoding == "xor_zstd":
        planes = np.frombuffer(codec.decompress(payload, count * isz), dtype=np.uint8).reshape(isz, count)
        xor = _unplanes(planes, codec.scratch("xor", count, dtype), codec)
        return np.bitwise_xor(old, xor, out=out)
    raw = np.frombuffer(codec.decompress(payload, _sparse_size(payload, count, dtype)), dtype=np.uint8)
    head = _SPARSE_HEADER.itemsize
    if raw.size < head:
        raise ValueError(f"sparse chunk holds {raw.size} bytes, less than its {head}-byte header")
    n = int(raw[:head].view(_SPARSE_HEADER)[0])
    if raw.size != head + n * (4 + isz):
        raise ValueError(f"sparse chunk of {n} changes holds {raw.size} bytes, expected {head + n * (4 + isz)}")
    gaps = _unplanes(raw[head : head + 4 * n].reshape(4, n), codec.scratch("gaps", n, "<u4"), codec)
    values = _unplanes(raw[head + 4 * n :].reshape(isz, n), codec.scratch("values", n, dtype), codec)
    where = np.cumsum(gaps, dtype=np.int64, out=codec.scratch("where", n, np.int64))
    if n and (where[-1] >= count or (n > 1 and np.any(gaps[1:] == 0))):
        raise ValueError(f"sparse chunk positions run outside its {count} elements or repeat")
    if out is not old:
        np.copyto(out, old)
    out[where] ^= values
    return out


def _sparse_size(payload: bytes | memoryview, count: int, dtype: np.dtype) -> int:
    """The decompressed size a sparse frame declares, bounded by what ``count`` elements can hold."""
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise ValueError(f"not a zstd frame ({e})") from None
    limit = _SPARSE_HEADER.itemsize + count * (4 + dtype.itemsize)
    if size < 0 or size > limit:
        raise ValueError(f"sparse chunk declares {size} bytes, more than {count} elements can hold ({limit})")
    return size
