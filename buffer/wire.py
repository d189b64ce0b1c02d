"""A lean codec for ``tether.v1.TrajectoryGroup``: the same wire format, without the copies.

Why hand-written, and why it stays: the buffer's budget is a raw ``XADD``/``XREADGROUP``/``XACK`` of the
same bytes, and at 1K-token completions Redis moves a G=8 group in ~100 µs. The generated classes
(Python's upb runtime) copy every per-token array three times to build a message (``tobytes``, the
field assignment, ``SerializeToString``; ~5 ms for a G=8 × 16K-token group) and twice more to parse
one, and :func:`tether.trajectory.validate` costs ~5 numpy calls per trajectory. Here encoding is one
``b"".join`` over the arrays' own buffers, decoding is one tight loop over the wire format that hands
out numpy views into the payload (no copy), and both validate the whole group at once
(:func:`tether.trajectory.validate_group`: the same checks and error messages, a handful of numpy calls).

Every field a rollout server writes is encoded by hand (maps and timestamps too: each sample carries its
sampling temperature and its start and finish times, and building a generated message for those cost
more than the rest of the trajectory); a value of an unexpected type goes to the generated classes. On
the way out the rare fields (maps, timestamps) are parsed by the generated parser, which is as fast for
them, and anything unexpected on the wire (an unknown field, a wire type that does not
match) falls back to :func:`tether.trajectory.decode_group`, so this module is never more permissive
than the generated parser. ``tests/unit/test_buffer_codec.py`` compares both paths message for message.
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
_ARRAY_TAGS = tuple(bytes((num << 3 | 2,)) for num, _, _ in _ARRAYS)
_BY_FIELD = {f: (name, dtype, dtype.itemsize) for f, name, dtype in _ARRAYS}
_STRINGS = {1: "id", 2: "group_id", 11: "server_id", 15: "logprob_source"}
_RARE = frozenset((9, 12, 13, 14))  # reward_components, started_at, finished_at, metadata: decoded by upb
_MAX_TIMESTAMP_S = 253_402_300_800  # 10000-01-01: google.protobuf.Timestamp's range ends before it
_DOUBLE = struct.Struct("<d")
_ONE_BYTE = [bytes((i,)) for i in range(128)]
# proto3 defaults, not TrajectoryData's (which would invent an id and say "raw" for a missing source).
_EMPTY = {name: np.empty(0, dtype) for _, name, dtype in _ARRAYS} | dict.fromkeys(_STRINGS.values(), "")


class _Fallback(Exception):
    """The fast decoder met something it does not handle; the generated parser decides."""


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _ONE_BYTE[n]
    # Array lengths of 128 B .. 2 MB (every per-token field of a real completion): no loop, no bytearray.
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0x200000:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _wire_array(arr: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``arr`` itself when it already is the wire layout (the usual case), else a converted copy."""
    # ``is`` first: numpy hands out one dtype instance per builtin type, and ``==`` costs ~10x more.
    if type(arr) is np.ndarray and (arr.dtype is dtype or arr.dtype == dtype) and arr.flags.c_contiguous:
        return arr
    return np.ascontiguousarray(np.asarray(arr), dtype=dtype)


def _map_entry(tag: bytes, key: str, value: bytes) -> bytes:
    """One entry of a ``map<string, …>`` field; ``value`` is the entry's field 2, tag included."""
    kb = key.encode()
    entry = b"\x0a" + _varint(len(kb)) + kb + value
    return tag + _varint(len(entry)) + entry


def _string_map(tag: bytes, items: dict[str, str]) -> bytes:
    out = b""
    for k, v in items.items():
        vb = v.encode()
        out += _map_entry(tag, k, b"\x12" + _varint(len(vb)) + vb)
    return out


def _timestamp(tag: bytes, when: float) -> bytes:
    seconds, nanos = divmod(int(when * 1e9), 1_000_000_000)  # what Timestamp.FromNanoseconds stores
    if not 0 <= seconds < _MAX_TIMESTAMP_S:
        raise _Fallback  # before 1970 or past 9999: the generated classes decide (and refuse)
    body = (b"\x08" + _varint(seconds) if seconds else b"") + (b"\x10" + _varint(nanos) if nanos else b"")
    return tag + _varint(len(body)) + body


def _rare_fields(t: TrajectoryData) -> bytes:
    """reward_components, started_at, finished_at and metadata, by hand: the generated classes cost more
    than the rest of a trajectory's encoding. Anything unusual (a non-string key, a value of the wrong
    type, a timestamp out of range) goes to the generated classes, which encode it or raise their error."""
    try:
        out = b""
        for k, v in t.reward_components.items():
            out += _map_entry(b"\x4a", k, b"\x11" + _DOUBLE.pack(v))
        if t.started_at:
            out += _timestamp(b"\x62", t.started_at)
        if t.finished_at:
            out += _timestamp(b"\x6a", t.finished_at)
        return out + _string_map(b"\x72", t.metadata)
    except (_Fallback, AttributeError, TypeError, ValueError, OverflowError, struct.error):
        rare = pb.Trajectory(reward_components=t.reward_components, metadata=t.metadata)
        if t.started_at:
            rare.started_at.FromNanoseconds(int(t.started_at * 1e9))
        if t.finished_at:
            rare.finished_at.FromNanoseconds(int(t.finished_at * 1e9))
        return rare.SerializeToString()


def _encode_trajectory(t: TrajectoryData, arrays: list[np.ndarray], group_field: bytes, parts: list) -> None:
    tid = t.id.encode()  # never empty: validate_group has run
    head = b"\x0a" + _varint(len(tid)) + tid + group_field
    body: list = [head]
    size = len(head)
    for tag, arr in zip(_ARRAY_TAGS, arrays, strict=True):
        if n := arr.nbytes:
            field = tag + _varint(n)
            body += (field, arr)  # joined straight from the array's buffer: no copy until the final join
            size += len(field) + n
    tail = b"\x41" + _DOUBLE.pack(float(t.reward)) if t.reward else b""
    if t.finish_reason:
        tail += b"\x50" + _varint(int(t.finish_reason))
    if t.server_id:
        raw = t.server_id.encode()
        tail += b"\x5a" + _varint(len(raw)) + raw
    if t.logprob_source:
        raw = t.logprob_source.encode()
        tail += b"\x7a" + _varint(len(raw)) + raw
    if t.reward_components or t.metadata or t.started_at or t.finished_at:  # every rollout server's sample
        tail += _rare_fields(t)  # fields may come in any order on the wire
    parts += (b"\x1a" + _varint(size + len(tail)), *body, tail)


def encode_group_checked(g: GroupData) -> tuple[bytes, int, int]:
    """``(payload, oldest policy version, completion tokens)``: :func:`encode_group_fast` plus what the
    buffer's entry header needs, computed by the same vectorised pass that validates the group."""
    parts: list = []
    group_field = b""
    if g.group_id:
        gid = g.group_id.encode()
        group_field = b"\x12" + _varint(len(gid)) + gid  # Trajectory.group_id: the same bytes for all G
        parts.append(b"\x0a" + _varint(len(gid)) + gid)
    if g.prompt_id:
        pid = g.prompt_id.encode()
        parts.append(b"\x12" + _varint(len(pid)) + pid)
    arrays = []
    for t in g.trajectories:
        if not t.group_id:
            t.group_id = g.group_id
        wire = [_wire_array(getattr(t, name), dtype) for _, name, dtype in _ARRAYS]
        arrays.append(wire)
    oldest = validate_group(g.trajectories)
    tokens = 0
    for t, wire in zip(g.trajectories, arrays, strict=True):
        if t.group_id == g.group_id:
            _encode_trajectory(t, wire, group_field, parts)
        else:  # a foreign trajectory: encoded as it is, and rejected by every decoder
            own = t.group_id.encode()
            _encode_trajectory(t, wire, b"\x12" + _varint(len(own)) + own, parts)
        tokens += wire[1].shape[0]
    if g.metadata:
        try:
            parts.append(_string_map(b"\x22", g.metadata))
        except (AttributeError, TypeError, ValueError):  # not str -> str: the generated classes say why
            parts.append(pb.TrajectoryGroup(metadata=g.metadata).SerializeToString())
    return b"".join(parts), oldest, tokens


def encode_group_fast(g: GroupData) -> bytes:
    """Wire-compatible with :func:`tether.trajectory.encode_group` (same validation, same message)."""
    return encode_group_checked(g)[0]


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
