"""A lean codec for ``tether.v1.TrajectoryGroup``: the same wire format, without the copies.

Why not just the generated classes: with Python's upb runtime, building a group message copies every
per-token array three times (``tobytes``, the field assignment, ``SerializeToString``) — ~5 ms for a
G=8 × 16K-token group, slower than Redis storing it — and parsing copies each array twice more. Here
encoding is one ``b"".join`` over the arrays' own buffers, and decoding walks the wire format and hands
out numpy views into the payload (no copy). Only the hot fields are handled by hand; the rare ones
(maps, timestamps) are encoded and decoded by the generated classes, and anything unexpected on the
wire (an unknown field, a wire type that does not match) falls back to :func:`tether.trajectory.decode_group`,
so this module is never more permissive than the generated parser. Validation is
:func:`tether.trajectory.validate`, the same as everywhere. Tests compare both paths message for message.
"""

from __future__ import annotations

import struct

import numpy as np

from tether.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    GroupData,
    InvalidTrajectory,
    TrajectoryData,
    decode_group,
    validate,
)
from tether.v1 import trajectory_pb2 as pb

_ARRAYS = (  # (field number, attribute, dtype) of the per-token byte fields
    (3, "prompt_token_ids", TOKEN_DTYPE),
    (4, "completion_token_ids", TOKEN_DTYPE),
    (5, "behavior_logprobs", LOGPROB_DTYPE),
    (6, "policy_versions", VERSION_DTYPE),
    (7, "loss_mask", MASK_DTYPE),
)
_BY_FIELD = {f: (name, dtype) for f, name, dtype in _ARRAYS}
_STRINGS = {1: "id", 2: "group_id", 11: "server_id", 15: "logprob_source"}
_DOUBLE = struct.Struct("<d")
_EMPTY = {name: np.empty(0, dtype) for _, name, dtype in _ARRAYS} | dict.fromkeys(_STRINGS.values(), "")


class _Fallback(Exception):
    """The fast decoder met something it does not handle; the generated parser decides."""


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(parts: list, tag: int, value: bytes | memoryview) -> int:
    head = bytes((tag,)) + _varint(len(value))
    parts.append(head)
    parts.append(value)
    return len(head) + len(value)


def _as_buffer(arr: np.ndarray, dtype: np.dtype) -> memoryview:
    a = arr if isinstance(arr, np.ndarray) and arr.dtype == dtype and arr.flags.c_contiguous else None
    if a is None:
        a = np.ascontiguousarray(np.asarray(arr), dtype=dtype)
    return memoryview(a).cast("B")


def _encode_trajectory(t: TrajectoryData, parts: list) -> None:
    body: list = []
    size = 0
    for num, name in ((1, "id"), (2, "group_id")):
        if value := getattr(t, name):
            size += _field(body, num << 3 | 2, value.encode())
    for num, name, dtype in _ARRAYS:
        buf = _as_buffer(getattr(t, name), dtype)
        if len(buf):
            size += _field(body, num << 3 | 2, buf)
    if t.reward:
        body.append(b"\x41" + _DOUBLE.pack(float(t.reward)))
        size += 9
    if t.finish_reason:
        chunk = b"\x50" + _varint(int(t.finish_reason))
        body.append(chunk)
        size += len(chunk)
    for num, name in ((11, "server_id"), (15, "logprob_source")):
        if value := getattr(t, name):
            size += _field(body, num << 3 | 2, value.encode())
    if t.reward_components or t.metadata or t.started_at or t.finished_at:
        rare = pb.Trajectory(reward_components=t.reward_components, metadata=t.metadata)
        if t.started_at:
            rare.started_at.FromNanoseconds(int(t.started_at * 1e9))
        if t.finished_at:
            rare.finished_at.FromNanoseconds(int(t.finished_at * 1e9))
        chunk = rare.SerializeToString()  # fields may come in any order on the wire
        body.append(chunk)
        size += len(chunk)
    parts.append(b"\x1a" + _varint(size))
    parts.extend(body)


def encode_group_fast(g: GroupData) -> bytes:
    """Wire-compatible with :func:`tether.trajectory.encode_group` (same validation, same message)."""
    parts: list = []
    if g.group_id:
        _field(parts, 0x0A, g.group_id.encode())
    if g.prompt_id:
        _field(parts, 0x12, g.prompt_id.encode())
    for t in g.trajectories:
        if not t.group_id:
            t.group_id = g.group_id
        validate(t)
        _encode_trajectory(t, parts)
    if g.metadata:
        parts.append(pb.TrajectoryGroup(metadata=g.metadata).SerializeToString())
    return b"".join(parts)


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


def _fields(buf: bytes, pos: int, end: int):
    """(field number, wire type, varint value, field start, value start, value stop) per field.

    Every field of these messages is numbered below 16, so a key is one byte; a longer key is a field
    this decoder does not know, and the generated parser takes over.
    """
    while pos < end:
        first = pos
        key = buf[pos]
        if key & 0x80:
            raise _Fallback
        pos += 1
        wt = key & 7
        if wt == 2:
            n = buf[pos] if pos < end else 0x80
            if n & 0x80:
                n, pos = _read_varint(buf, pos, end)
            else:
                pos += 1
            if pos + n > end:
                raise _Fallback
            yield key >> 3, 2, 0, first, pos, pos + n
            pos += n
        elif wt == 0:
            value, pos = _read_varint(buf, pos, end)
            yield key >> 3, 0, value, first, pos, pos
        elif wt == 1:
            if pos + 8 > end:
                raise _Fallback
            yield key >> 3, 1, 0, first, pos, pos + 8
            pos += 8
        else:
            raise _Fallback


def _decode_trajectory(data: bytes, start: int, end: int) -> TrajectoryData:
    # proto3 defaults, not TrajectoryData's (which would invent an id and say "raw" for a missing source).
    kw: dict = dict(_EMPTY)
    rare: list[bytes] = []
    for num, wt, value, first, a, b in _fields(data, start, end):
        if wt == 2 and num in _BY_FIELD:
            name, dtype = _BY_FIELD[num]
            if (b - a) % dtype.itemsize:
                raise InvalidTrajectory(f"{name} has {b - a} bytes, not a multiple of {dtype.itemsize}")
            kw[name] = np.frombuffer(data, dtype=dtype, count=(b - a) // dtype.itemsize, offset=a)
        elif wt == 2 and num in _STRINGS:
            kw[_STRINGS[num]] = data[a:b].decode()
        elif num == 8 and wt == 1:
            kw["reward"] = _DOUBLE.unpack_from(data, a)[0]
        elif num == 10 and wt == 0:
            kw["finish_reason"] = value
        elif num in (9, 12, 13, 14) and wt == 2:
            rare.append(data[first:b])  # the whole field, for the generated parser
        else:
            raise _Fallback
    t = TrajectoryData(**kw)
    if rare:
        msg = pb.Trajectory.FromString(b"".join(rare))
        t.reward_components = dict(msg.reward_components)
        t.metadata = dict(msg.metadata)
        t.started_at = msg.started_at.ToNanoseconds() / 1e9 if msg.HasField("started_at") else 0.0
        t.finished_at = msg.finished_at.ToNanoseconds() / 1e9 if msg.HasField("finished_at") else 0.0
    validate(t)
    return t


def decode_group_fast(data: bytes) -> GroupData:
    """Like :func:`tether.trajectory.decode_group` (same checks, same errors), but the per-token arrays are
    read-only numpy views into ``data``."""
    try:
        return _decode_group(data)
    except (_Fallback, UnicodeDecodeError, struct.error):
        return decode_group(data)


def _decode_group(data: bytes) -> GroupData:
    buf = data
    group_id = prompt_id = ""
    trajectories: list[TrajectoryData] = []
    rare: list[bytes] = []
    for num, wt, _, first, a, b in _fields(buf, 0, len(buf)):
        if wt != 2:
            raise _Fallback
        if num == 1:
            group_id = buf[a:b].decode()
        elif num == 2:
            prompt_id = buf[a:b].decode()
        elif num == 3:
            trajectories.append(_decode_trajectory(data, a, b))
        elif num == 4:
            rare.append(buf[first:b])
        else:
            raise _Fallback
    if not group_id:
        raise InvalidTrajectory("trajectory group has no group_id")
    if not trajectories:
        raise InvalidTrajectory(f"trajectory group {group_id} is empty")
    for t in trajectories:
        if t.group_id != group_id:
            raise InvalidTrajectory(f"trajectory {t.id} has group_id {t.group_id!r}, its group is {group_id!r}")
    metadata = dict(pb.TrajectoryGroup.FromString(b"".join(rare)).metadata) if rare else {}
    return GroupData(group_id=group_id, trajectories=trajectories, prompt_id=prompt_id, metadata=metadata)
