"""How one trajectory group is laid out in Redis (the rules that decide what happens to it are in
:mod:`buffer.policy`).

A trajectories-stream entry is a small header: ``g`` (group id), ``v`` (the oldest policy version, so a
stale group is dropped without fetching or parsing its payload), ``n`` (payload bytes, so the byte bound
is kept without reading the payload back), ``c`` (the codec), ``k`` (the nonce of the payload key,
:meth:`buffer.keys.RedisKeys.payload`) and ``l`` (its completions' lengths, bucketed: :mod:`buffer.lengths`,
so whatever the entry ends in is booked by length without its payload). The payload lives in that key,
not in the entry, so the insert script never carries it (see :mod:`buffer.scripts`); an entry written by
hand may still carry it inline as ``d``, and is read the same way.

One codec writes a group, wherever it travels: the columnar group of :mod:`buffer.columnar` (codec
``col``: a JSON header and the group's per-token arrays concatenated, decoded into numpy views without
Python work per token). The learner's rank 0 forwards the very bytes it read to its other ranks
(:func:`decode_group_columnar` hands them out beside the group; :func:`learner.batch.broadcast_groups`
sends them), so no group is encoded twice. It is zlib-compressed (codec ``colz``) only when asked and
above a size threshold: per-token arrays of random log-probs barely compress, and compression costs far
more CPU than Redis spends storing the bytes, so it pays only on slow links. Nothing here is ever pickled;
a payload that is not a valid group raises :class:`InvalidTrajectory`, and so does one of any other codec
tag — the protobuf ``pb``/``pbz`` of development builds before the columnar codec included, which nothing
reads any more — so the reader dead-letters it with that reason.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from buffer.columnar import decode_columnar, encode_columnar
from buffer.lengths import encode_counts
from tether.trajectory import GroupData, InvalidTrajectory

CODEC_COLUMNAR = b"col"
CODEC_COLUMNAR_ZLIB = b"colz"
_COMPRESSED = {CODEC_COLUMNAR: False, CODEC_COLUMNAR_ZLIB: True}  # every codec this reader knows

# A decompressed group larger than protobuf's own message limit cannot be valid: stop there rather
# than let a hostile or corrupt payload inflate without bound (a "zip bomb").
MAX_DECODED_BYTES = 2**31 - 1

F_GROUP, F_VERSION, F_CODEC, F_BYTES, F_NONCE, F_DATA, F_LENGTHS = b"g", b"v", b"c", b"n", b"k", b"d", b"l"


@dataclass(frozen=True)
class Encoded:
    """One group ready for :meth:`buffer.TrajectoryWriter.put_encoded`."""

    codec: bytes
    payload: bytes
    oldest_version: int
    tokens: int
    lengths: str = ""  # the header's ``l``: buffer.lengths.encode_counts of the completion lengths


def encode_group_payload(
    group: GroupData, *, compression: str = "none", compress_min_bytes: int = 0, level: int = 1
) -> Encoded:
    """The payload of one group plus its header values, from one validating pass over the group."""
    data, oldest, tokens = encode_columnar(group)
    lengths = encode_counts(t.num_completion_tokens for t in group.trajectories)
    if compression == "zlib" and len(data) >= compress_min_bytes:
        packed = zlib.compress(data, level)
        # Keep the plain bytes when compression does not shrink them (random log-probs, tiny groups).
        if len(packed) < len(data):
            return Encoded(CODEC_COLUMNAR_ZLIB, packed, oldest, tokens, lengths)
    return Encoded(CODEC_COLUMNAR, data, oldest, tokens, lengths)


def encode_payload(
    group: GroupData, *, compression: str = "none", compress_min_bytes: int = 0, level: int = 1
) -> tuple[bytes, bytes]:
    """``(codec, payload)`` for one group; raises :class:`InvalidTrajectory` if the group is malformed."""
    enc = encode_group_payload(group, compression=compression, compress_min_bytes=compress_min_bytes, level=level)
    return enc.codec, enc.payload


def _inflate(payload: bytes) -> bytes:
    d = zlib.decompressobj()
    try:
        out = d.decompress(payload, MAX_DECODED_BYTES)
    except zlib.error as e:
        raise InvalidTrajectory(f"zlib payload does not decompress: {e}") from None
    if d.unconsumed_tail:
        raise InvalidTrajectory(f"zlib payload inflates beyond {MAX_DECODED_BYTES} bytes")
    if not d.eof:
        raise InvalidTrajectory("zlib payload is truncated")
    return out


def decode_group_columnar(codec: bytes, payload: bytes) -> tuple[GroupData, int, bytes]:
    """``(group, oldest policy version, columnar bytes)`` from one validating pass; the bytes are the
    group's columnar encoding as read (inflated when compressed; the group's arrays are views into them),
    ready to travel on without encoding again."""
    try:
        compressed = _COMPRESSED[codec]
    except (KeyError, TypeError):
        known = ", ".join(repr(c) for c in _COMPRESSED)
        raise InvalidTrajectory(f"unknown payload codec {bytes(codec[:32])!r} (this reader knows {known})") from None
    data = _inflate(payload) if compressed else payload
    group, oldest = decode_columnar(data)
    return group, oldest, bytes(data)


def decode_group_payload(codec: bytes, payload: bytes) -> tuple[GroupData, int]:
    """``(group, oldest policy version)`` from one validating pass; :class:`InvalidTrajectory` otherwise."""
    group, oldest, _ = decode_group_columnar(codec, payload)
    return group, oldest


def decode_payload(codec: bytes, payload: bytes) -> GroupData:
    """The group in ``payload``, validated; :class:`InvalidTrajectory` says what is wrong otherwise."""
    return decode_group_payload(codec, payload)[0]


@dataclass(frozen=True)
class EntryHeader:
    """The small fields of a trajectories-stream entry; ``oldest_version`` is None when absent/unreadable."""

    group_id: str
    oldest_version: int | None
    codec: bytes
    nbytes: int
    nonce: str  # of the payload key; "" when the payload is inline (or missing)
    lengths: str = ""  # completions per length bucket (buffer.lengths); "" when absent


def _int_or_none(raw: bytes | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def _plausible_bytes(n: int | None) -> int:
    # The byte count is subtracted from the buffer's byte counter in a Lua script, where a number of
    # 1e17 or more becomes a float and HINCRBY fails — one hand-written entry would then make every
    # read fail. No payload a writer stored can exceed MAX_DECODED_BYTES, so anything else counts as 0.
    return n if n is not None and 0 <= n <= MAX_DECODED_BYTES else 0


def read_header(fields: Mapping[bytes, bytes]) -> EntryHeader:
    """Never raises: an entry that was not written by :class:`~buffer.TrajectoryWriter` still gets a header
    (so it can be dead-lettered with its byte count) and fails later, in :func:`decode_payload`."""
    gid = fields.get(F_GROUP, b"")
    return EntryHeader(
        group_id=gid.decode("utf-8", "replace"),
        oldest_version=_int_or_none(fields.get(F_VERSION)),
        codec=fields.get(F_CODEC, b""),
        nbytes=_plausible_bytes(_int_or_none(fields.get(F_BYTES))),
        nonce=fields.get(F_NONCE, b"").decode("ascii", "replace"),
        lengths=fields.get(F_LENGTHS, b"").decode("ascii", "replace")[:1000],
    )
