"""The reader of legacy protobuf payloads: trajectory groups written as ``tether.v1.TrajectoryGroup``
(codec ``pb``/``pbz`` of :mod:`buffer.codec`) before the columnar codec (:mod:`buffer.columnar`).

Read only, and kept only for old data: nothing in tether writes a group in this format any more (rollout
servers, the buffer and the learner's rank broadcast all carry the columnar payload), but a Redis that
outlives an upgrade — a resumed run's stream, its pending entries, its dead letters — can still hold
entries written before, and the reader must decode them or dead-letter them with a reason, never fail.
Delete this module, and the ``pb`` codecs, once no such data can be left.

Why hand-written rather than the generated parser alone: the generated classes (Python's upb runtime)
copy every per-token array twice to parse a message, and :func:`tether.trajectory.validate` costs ~5
numpy calls per trajectory. Here decoding is one tight loop over the wire format that hands out numpy
views into the payload (no copy), and validates the whole group at once
(:func:`tether.trajectory.validate_group`: the same checks and error messages, a handful of numpy calls).
The rare fields (maps, timestamps) are parsed by the generated parser, which is as fast for them, and
anything unexpected on the wire (an unknown field, a wire type that does not match) falls back to
:func:`tether.trajectory.decode_group`, so this module is never more permissive than the generated
parser. ``tests/unit/test_buffer_codec.py`` compares both paths message for message.
"""

from __future__ import annotations

import struct

import numpy as np
from google.protobuf.message import DecodeError

from tether.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    GroupData,
    InvalidTrajectory,
    TrajectoryData,
    decode_group,
    validate_group,
)
from tether.v1 import trajectory_pb2 as pb

_ARRAYS = (  # (field number, attribute, dtype) of the per-token byte fields, in wire order
    (3, "prompt_token_ids", TOKEN_DTYPE),
    (4, "completion_token_ids", TOKEN_DTYPE),
    (5, "behavior_logprobs", LOGPROB_DTYPE),
    (6, "policy_versions", VERSION_DTYPE),
    (7, "loss_mask", MASK_DTYPE),
)
_BY_FIELD = {f: (name, dtype, dtype.itemsize) for f, name, dtype in _ARRAYS}
_STRINGS = {1: "id", 2: "group_id", 11: "server_id", 15: "logprob_source"}
_RARE = frozenset((9, 12, 13, 14))  # reward_components, started_at, finished_at, metadata: decoded by upb
_DOUBLE = struct.Struct("<d")
# proto3 defaults, not TrajectoryData's (which would invent an id and say "raw" for a missing source).
_EMPTY = {name: np.empty(0, dtype) for _, name, dtype in _ARRAYS} | dict.fromkeys(_STRINGS.values(), "")


class _Fallback(Exception):
    """The fast decoder met something it does not handle; the generated parser decides."""


def _read_varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            break
    raise _Fallback


def _decode_trajectory(data: bytes, pos: int, end: int) -> TrajectoryData:
    # One inlined loop (no generator, no per-field tuples): at G=8 this loop runs ~80 times per group.
    kw: dict = dict(_EMPTY)
    rare: list[bytes] = []
    while pos < end:
        first = pos
        key = data[pos]
        if key & 0x80:  # every field here is numbered below 16: a longer key is one we do not know
            raise _Fallback
        pos += 1
        num = key >> 3
        wt = key & 7
        if wt == 2:
            if pos >= end:
                raise _Fallback
            n = data[pos]
            if not n & 0x80:
                pos += 1
            elif pos + 1 < end and not data[pos + 1] & 0x80:  # 128 B .. 16 KB: most per-token arrays
                n = (n & 0x7F) | data[pos + 1] << 7
                pos += 2
            else:
                n, pos = _read_varint(data, pos, end)
            stop = pos + n
            if stop > end:
                raise _Fallback
            spec = _BY_FIELD.get(num)
            if spec is not None:
                name, dtype, size = spec
                if n % size:
                    raise InvalidTrajectory(f"{name} has {n} bytes, not a multiple of {size}")
                kw[name] = np.frombuffer(data, dtype, n // size, pos)  # positional: half the call cost
            elif num in _STRINGS:
                kw[_STRINGS[num]] = data[pos:stop].decode()
            elif num in _RARE:
                rare.append(data[first:stop])  # the whole field, for the generated parser
            else:
                raise _Fallback
            pos = stop
        elif wt == 1 and num == 8:
            if pos + 8 > end:
                raise _Fallback
            kw["reward"] = _DOUBLE.unpack_from(data, pos)[0]
            pos += 8
        elif wt == 0 and num == 10:
            kw["finish_reason"], pos = _read_varint(data, pos, end)
        else:
            raise _Fallback
    t = TrajectoryData(**kw)
    if rare:
        msg = pb.Trajectory.FromString(b"".join(rare))
        t.reward_components = dict(msg.reward_components)
        t.metadata = dict(msg.metadata)
        t.started_at = msg.started_at.ToNanoseconds() / 1e9 if msg.HasField("started_at") else 0.0
        t.finished_at = msg.finished_at.ToNanoseconds() / 1e9 if msg.HasField("finished_at") else 0.0
    return t


def decode_group_checked(data: bytes) -> tuple[GroupData, int]:
    """``(group, oldest policy version)``, validated; see :func:`decode_group_fast`."""
    try:
        return _decode_group(data)
    # DecodeError: a corrupt map or timestamp, met by the generated parser of the rare fields.
    except (_Fallback, UnicodeDecodeError, struct.error, IndexError, DecodeError):
        group = decode_group(data)  # the generated parser: same checks, its own error messages
        return group, group.oldest_version


def decode_group_fast(data: bytes) -> GroupData:
    """Like :func:`tether.trajectory.decode_group` (same checks, same errors), but the per-token arrays are
    read-only numpy views into ``data``."""
    return decode_group_checked(data)[0]


def _decode_group(data: bytes) -> tuple[GroupData, int]:
    group_id = prompt_id = ""
    trajectories: list[TrajectoryData] = []
    rare: list[bytes] = []
    pos, end = 0, len(data)
    while pos < end:
        first = pos
        key = data[pos]
        if key & 7 != 2 or key & 0x80:
            raise _Fallback
        pos += 1
        n = data[pos] if pos < end else 0x80
        if n & 0x80:
            n, pos = _read_varint(data, pos, end)
        else:
            pos += 1
        stop = pos + n
        if stop > end:
            raise _Fallback
        num = key >> 3
        if num == 3:
            trajectories.append(_decode_trajectory(data, pos, stop))
        elif num == 1:
            group_id = data[pos:stop].decode()
        elif num == 2:
            prompt_id = data[pos:stop].decode()
        elif num == 4:
            rare.append(data[first:stop])
        else:
            raise _Fallback
        pos = stop
    if not group_id:
        raise InvalidTrajectory("trajectory group has no group_id")
    if not trajectories:
        raise InvalidTrajectory(f"trajectory group {group_id} is empty")
    oldest = validate_group(trajectories)  # the checks in decode_group's order: group, trajectories, ids
    for t in trajectories:
        if t.group_id != group_id:
            raise InvalidTrajectory(f"trajectory {t.id} has group_id {t.group_id!r}, its group is {group_id!r}")
    metadata = dict(pb.TrajectoryGroup.FromString(b"".join(rare)).metadata) if rare else {}
    return GroupData(group_id=group_id, trajectories=trajectories, prompt_id=prompt_id, metadata=metadata), oldest
