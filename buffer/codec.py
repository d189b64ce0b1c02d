"""How one trajectory group is laid out in a stream entry, and the pure arithmetic of admission.

An entry carries a few small header fields next to the payload so the buffer can act on an entry
without parsing it: ``v`` (the oldest policy version, so a stale group is dropped undecoded), ``n``
(payload bytes, so the byte bound is kept without reading the payload back) and ``c`` (the codec).
The payload is the protobuf ``TrajectoryGroup`` (built by :mod:`buffer.wire`, which avoids copies), zlib-
compressed only above a size threshold: per-token arrays of random log-probs barely compress, and
compression costs far more CPU than Redis spends storing the bytes, so it pays only on slow links.
Nothing here is ever pickled; a payload that is not a valid group raises :class:`InvalidTrajectory`.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass

from buffer.wire import decode_group_fast, encode_group_fast
from tether.trajectory import GroupData, InvalidTrajectory

CODEC_PROTOBUF = b"pb"
CODEC_PROTOBUF_ZLIB = b"pbz"

# A decompressed group larger than protobuf's own message limit cannot be valid: stop there rather
# than let a hostile or corrupt payload inflate without bound (a "zip bomb").
MAX_DECODED_BYTES = 2**31 - 1

F_GROUP, F_VERSION, F_CODEC, F_BYTES, F_DATA = b"g", b"v", b"c", b"n", b"d"


def encode_payload(
    group: GroupData, *, compression: str = "none", compress_min_bytes: int = 0, level: int = 1
) -> tuple[bytes, bytes]:
    """``(codec, payload)`` for one group; raises :class:`InvalidTrajectory` if the group is malformed."""
    data = encode_group_fast(group)
    if compression == "zlib" and len(data) >= compress_min_bytes:
        packed = zlib.compress(data, level)
        # Keep the plain bytes when compression does not shrink them (random log-probs, tiny groups).
        if len(packed) < len(data):
            return CODEC_PROTOBUF_ZLIB, packed
    return CODEC_PROTOBUF, data


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


def decode_payload(codec: bytes, payload: bytes) -> GroupData:
    """The group in ``payload``, validated; :class:`InvalidTrajectory` says what is wrong otherwise."""
    if codec == CODEC_PROTOBUF_ZLIB:
        payload = _inflate(payload)
    elif codec != CODEC_PROTOBUF:
        raise InvalidTrajectory(f"unknown payload codec {codec[:32]!r} (expected {CODEC_PROTOBUF!r} or zlib)")
    return decode_group_fast(payload)


@dataclass(frozen=True)
class EntryHeader:
    """The small fields of a trajectories-stream entry; ``oldest_version`` is None when absent/unreadable."""

    group_id: str
    oldest_version: int | None
    codec: bytes
    nbytes: int


def _int_or_none(raw: bytes | None) -> int | None:
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def read_header(fields: Mapping[bytes, bytes]) -> EntryHeader:
    """Never raises: an entry that was not written by :class:`~buffer.TrajectoryWriter` still gets a header
    (so it can be dead-lettered with its byte count) and fails later, in :func:`decode_payload`."""
    gid = fields.get(F_GROUP, b"")
    return EntryHeader(
        group_id=gid.decode("utf-8", "replace"),
        oldest_version=_int_or_none(fields.get(F_VERSION)),
        codec=fields.get(F_CODEC, b""),
        nbytes=_int_or_none(fields.get(F_BYTES)) or 0,
    )


def admission_allowance(issued: int, *, version: int, prompts_per_version: int, max_staleness: int) -> int:
    """Prompts that may be issued now under AReaL's rule ``issued ≤ (max_staleness + version + 1)·B``.

    With ``max_staleness = 0`` exactly one version's worth is ever ahead of the learner: synchronous RL.
    """
    if prompts_per_version <= 0:
        raise ValueError(f"prompts_per_version must be positive, got {prompts_per_version}")
    if max_staleness < 0 or version < 0:
        raise ValueError(f"max_staleness and version must be >= 0, got {max_staleness} and {version}")
    return max(0, (max_staleness + version + 1) * prompts_per_version - issued)


def staleness_of(oldest_version: int, current_version: int) -> int:
    """Versions the learner is ahead of a group's oldest token; a group with no tokens, or one tagged with a
    version the learner has not reached (a learner resumed from an older checkpoint), counts as fresh."""
    if oldest_version < 0:
        return 0
    return max(0, current_version - oldest_version)
