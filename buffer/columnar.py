"""The columnar payload of a trajectory group: a small header (the numbers packed, the strings as JSON),
then each per-token array of the whole group concatenated, so that neither side does Python work per
token or per array field.

This is the one codec a group is written and read in (the stream, dead letters, the learner's rank
broadcast). Why not a protobuf ``tether.v1.TrajectoryGroup``, the format before this one (nothing reads it
any more): at 1K-token completions Redis moves a G=8 group in ~330 µs, and walking the protobuf wire
format in Python costs ~40 fields and ~30 µs per trajectory each way. Here encoding is one
``struct.pack`` of the numbers, one ``json.dumps`` of the strings and one ``b"".join`` over the arrays'
own buffers; decoding is one ``struct.unpack_from``, one ``json.loads``, five
``np.frombuffer`` views into the payload (no copy, read-only) sliced per trajectory, and the checks of
:func:`tether.trajectory.validate` as four reductions over whole columns. Per-token arrays of
different lengths cannot be expressed: every completion column is cut at the same offsets.

Layout, version 1 (little-endian)::

    b"TGC" + version (1 byte) | G (u32) | H (u32) | 0 (u32)
    | reward f8[G] | started_at f8[G] | finished_at f8[G] | completion length i4[G] | prompt length i4[G]
    | finish_reason i4[G] | header: H bytes of JSON, spaces at its end so the columns start 8-aligned
    | behavior_logprobs f4[C] | completion_token_ids i4[C] | policy_versions i4[C] | prompt_token_ids i4[P]
    | loss_mask u1[C]

with C and P the sums of the lengths, and the payload exactly that long. The JSON header holds the
strings: ``g`` (group id), ``p`` (prompt id), ``m`` (group metadata) and per trajectory ``id``, ``s``
(server id), ``ls`` (log-prob source), ``rc`` (reward components) and ``tm`` (metadata). A payload
with another magic or version raises :class:`~tether.trajectory.InvalidTrajectory` saying so, which the
reader turns into a dead letter.
"""

from __future__ import annotations

import json
import struct
from dataclasses import fields
from functools import lru_cache
from itertools import accumulate, chain, repeat

import numpy as np

from tether.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    GroupData,
    InvalidTrajectory,
    TrajectoryData,
    validate,
)

MAGIC = b"TGC"
VERSION = 1
_PREFIX = struct.Struct("<3sBIII")  # magic, version, G, H, 0
# (attribute, dtype, counted by "nc" (completion) or "np" (prompt)), in payload order: 4-byte types first,
# so every column stays aligned.
_COLUMNS = (
    ("behavior_logprobs", LOGPROB_DTYPE, "nc"),
    ("completion_token_ids", TOKEN_DTYPE, "nc"),
    ("policy_versions", VERSION_DTYPE, "nc"),
    ("prompt_token_ids", TOKEN_DTYPE, "np"),
    ("loss_mask", MASK_DTYPE, "nc"),
)
_BYTES_PER_COMPLETION_TOKEN = sum(d.itemsize for _, d, counted in _COLUMNS if counted == "nc")
# The order of TrajectoryData's fields, in which the decoder passes them positionally.
_FIELDS = (
    "prompt_token_ids", "completion_token_ids", "behavior_logprobs", "policy_versions", "loss_mask", "reward",
    "reward_components", "finish_reason", "id", "group_id", "server_id", "logprob_source", "metadata",
    "started_at", "finished_at",
)  # fmt: skip
if tuple(f.name for f in fields(TrajectoryData)) != _FIELDS:
    raise ImportError("buffer.columnar: TrajectoryData's fields changed order; update _FIELDS and decode_columnar")
_MAX_GROUP = 1 << 16  # trajectories per group: far above any G, and a bound on what a header may claim


@lru_cache(maxsize=64)
def _numbers(g: int) -> struct.Struct:
    """The fixed-size block of one group's per-trajectory numbers (see the module docstring)."""
    return struct.Struct(f"<{3 * g}d{3 * g}i")


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=True).encode
_loads = json.JSONDecoder().decode


def _refuse(trajectories: list[TrajectoryData]) -> InvalidTrajectory:
    """The error :func:`tether.trajectory.validate` gives the first bad trajectory (it raises it)."""
    for t in trajectories:
        validate(t)
    return InvalidTrajectory("trajectory group failed validation")  # not reached: validate raises first


def _check_columns(views: dict[str, np.ndarray], trajectories: list[TrajectoryData]) -> int:
    """The checks of :func:`~tether.trajectory.validate` over whole columns; the group's oldest version."""
    completions, prompts = views["completion_token_ids"], views["prompt_token_ids"]
    versions, mask = views["policy_versions"], views["loss_mask"]
    oldest = int(versions.min()) if versions.size else -1
    if (
        (completions.size and completions.min() < 0)
        or (prompts.size and prompts.min() < 0)
        or (mask.size and mask.max() > 1)
        or (versions.size and oldest < 0)
    ):
        raise _refuse(trajectories)
    return oldest


def encode_columnar(g: GroupData) -> tuple[bytes, int, int]:
    """``(payload, oldest policy version, completion tokens)``; :class:`InvalidTrajectory` (the message
    :func:`tether.trajectory.validate` would give) for a malformed group."""
    if not g.group_id:
        raise InvalidTrajectory("trajectory group has no group_id")
    if not g.trajectories:
        raise InvalidTrajectory(f"trajectory group {g.group_id} is empty")
    ts = g.trajectories
    n_prompt, n_completion = [], []
    for t in ts:
        if not t.group_id:
            t.group_id = g.group_id
        elif t.group_id != g.group_id:
            raise InvalidTrajectory(f"trajectory {t.id} has group_id {t.group_id!r}, its group is {g.group_id!r}")
        n = len(t.completion_token_ids)
        if not t.id or len(t.behavior_logprobs) != n or len(t.policy_versions) != n or len(t.loss_mask) != n:
            raise _refuse(ts)
        n_prompt.append(len(t.prompt_token_ids))
        n_completion.append(n)
    g_count = len(ts)
    if g_count > _MAX_GROUP:
        raise InvalidTrajectory(f"trajectory group {g.group_id} has {g_count} trajectories (at most {_MAX_GROUP})")
    try:
        numbers = _numbers(g_count).pack(
            *[t.reward for t in ts],
            *[t.started_at for t in ts],
            *[t.finished_at for t in ts],
            *n_completion,
            *n_prompt,
            *[t.finish_reason for t in ts],
        )
        head = _dumps(
            {
                "g": g.group_id,
                "p": g.prompt_id,
                "m": g.metadata,
                "id": [t.id for t in ts],
                "s": [t.server_id for t in ts],
                "ls": [t.logprob_source for t in ts],
                "rc": [_plain_numbers(t.reward_components) for t in ts],
                "tm": [t.metadata for t in ts],
            }
        ).encode()
    except (TypeError, ValueError, struct.error) as e:  # a reward that is not a number, a non-string key, ...
        raise InvalidTrajectory(f"trajectory group {g.group_id}: a field has the wrong type ({e})") from None
    if min(t.finish_reason for t in ts) < 0:
        raise InvalidTrajectory(f"trajectory group {g.group_id}: a negative finish reason")
    if _needs_recheck(ts, g):
        _check_header(_loads(head.decode()), g_count)
    pad = -(_PREFIX.size + len(numbers) + len(head)) % 8
    start = _PREFIX.size + len(numbers) + len(head) + pad
    total_c, total_p = sum(n_completion), sum(n_prompt)
    parts = [_PREFIX.pack(MAGIC, VERSION, g_count, len(head) + pad, 0), numbers, head, b" " * pad]
    for name, dtype, _ in _COLUMNS:  # joined straight from the arrays' own buffers: the one copy
        parts += [_column_piece(getattr(t, name), dtype, name) for t in ts]
    payload = b"".join(parts)
    views = _views(payload, start, total_c, total_p)
    return payload, _check_columns(views, ts), sum(n_completion)


def _column_piece(arr: object, dtype: np.dtype, name: str) -> np.ndarray:
    """``arr`` itself when it already has the wire layout (the usual case), else a converted copy; a value of
    another kind (float token ids) or shape raises :class:`InvalidTrajectory` rather than being cut to fit."""
    # ``is`` first: numpy hands out one dtype instance per builtin type, and ``==`` costs ~10x more.
    if (
        type(arr) is np.ndarray
        and (arr.dtype is dtype or arr.dtype == dtype)
        and arr.ndim == 1
        and arr.flags.c_contiguous
    ):
        return arr
    try:
        out = np.asarray(arr)
        if out.ndim != 1:
            raise ValueError(f"shape {out.shape}, not one dimension")
        if out.dtype.kind not in "biu" and dtype.kind in "iu":  # ids, versions, masks: integers only
            raise TypeError(f"values of dtype {out.dtype} are not integers")
        return np.ascontiguousarray(out, dtype)
    except (TypeError, ValueError) as e:
        raise InvalidTrajectory(f"{name} does not fit the wire's {dtype} ({e})") from None


def _plain_numbers(components: dict) -> dict:
    """``components`` itself when JSON can write it as it is, else its values as Python floats (numpy scalars
    from a reward function); anything that is not a number stays, and JSON refuses it."""
    if _only(components.values(), float, int):
        return components
    try:
        return {k: float(v) for k, v in components.items()}
    except (TypeError, ValueError):
        return components


def _needs_recheck(ts: list[TrajectoryData], g: GroupData) -> bool:
    """Whether the header must be read back through the decoder's checks before it is stored: only when a
    field holds something other than what the decoder accepts (cheap type tests, no JSON round trip)."""
    strings = [g.prompt_id, *(x for t in ts for x in (t.id, t.server_id, t.logprob_source))]
    return not (
        _only(strings, str)
        and _str_maps([g.metadata, *(t.metadata for t in ts)])
        and _num_maps([t.reward_components for t in ts])
    )


def _only(values: object, *kinds: type) -> bool:
    """Whether every element of ``values`` has exactly one of ``kinds`` as its type (``bool`` is not an
    ``int`` here); one C-level pass, no Python per element."""
    return set(map(type, values)) <= set(kinds)  # type: ignore[call-overload]


def _str_maps(maps: list) -> bool:
    """Whether every element of ``maps`` is a ``dict[str, str]`` (four C-level passes for all of them)."""
    return _only(maps, dict) and _only(chain.from_iterable(maps), str) and _only(chain(*map(dict.values, maps)), str)


def _num_maps(maps: list) -> bool:
    """Whether every element of ``maps`` is a ``dict[str, float | int]``."""
    return (
        _only(maps, dict)
        and _only(chain.from_iterable(maps), str)
        and _only(chain(*map(dict.values, maps)), float, int)
    )


def _views(data: bytes, offset: int, n_completion: int, n_prompt: int) -> dict[str, np.ndarray]:
    views = {}
    for name, dtype, counted in _COLUMNS:
        count = n_completion if counted == "nc" else n_prompt
        views[name] = np.frombuffer(data, dtype, count, offset)
        offset += count * dtype.itemsize
    return views


def _list(head: dict, key: str, g: int, kind: type) -> list:
    value = head.get(key)
    if type(value) is not list or len(value) != g or not _only(value, kind):
        raise InvalidTrajectory(f"columnar payload: header field {key!r} is not a list of {g} {kind.__name__}s")
    return value


def _header_ok(head: object, g: int) -> bool:
    """Whether the header passes every check of :func:`_check_header`, in a few C-level passes."""
    if type(head) is not dict:
        return False
    gid, ids, servers, sources, rcs, tms = map(head.get, ("g", "id", "s", "ls", "rc", "tm"))
    lists = (ids, servers, sources, rcs, tms)
    return (
        type(gid) is str
        and gid != ""
        and type(head.get("p")) is str
        and _only(lists, list)
        and set(map(len, lists)) == {g}
        and _only(chain(ids, servers, sources), str)
        and all(ids)
        and _num_maps(rcs)
        and _str_maps([head.get("m"), *tms])
    )


def _check_header(head: object, g: int) -> None:
    """Raises :class:`InvalidTrajectory` naming the first header field that is missing or of the wrong type."""
    if _header_ok(head, g):
        return
    if type(head) is not dict:
        raise InvalidTrajectory("columnar payload: the header is not a JSON object")
    for key in ("g", "p"):
        if type(head.get(key)) is not str:
            raise InvalidTrajectory(f"columnar payload: header field {key!r} is not a string")
    if not head["g"]:
        raise InvalidTrajectory("trajectory group has no group_id")
    if not _str_maps([head.get("m")]):
        raise InvalidTrajectory("columnar payload: group metadata is not a map of strings")
    for key in ("id", "s", "ls"):
        _list(head, key, g, str)
    if not _num_maps(_list(head, "rc", g, dict)):
        raise InvalidTrajectory("columnar payload: reward components are not a map of string to number")
    if not _str_maps(_list(head, "tm", g, dict)):
        raise InvalidTrajectory("columnar payload: trajectory metadata is not a map of string to string")
    if not all(head["id"]):
        raise InvalidTrajectory("trajectory has no id")


def decode_columnar(data: bytes) -> tuple[GroupData, int]:
    """``(group, oldest policy version)``, validated; the per-token arrays are read-only views into ``data``."""
    g, hlen = _read_prefix(data)
    numbers = _numbers(g)
    start = _PREFIX.size + numbers.size + hlen
    if start > len(data):
        raise InvalidTrajectory(f"columnar payload: header of {hlen} bytes runs past the payload's end")
    values = numbers.unpack_from(data, _PREFIX.size)
    rewards, started, finished = values[:g], values[g : 2 * g], values[2 * g : 3 * g]
    n_completion, n_prompt, reasons = values[3 * g : 4 * g], values[4 * g : 5 * g], values[5 * g :]
    if min(n_completion) < 0 or min(n_prompt) < 0 or min(reasons) < 0:
        raise InvalidTrajectory("columnar payload: a negative array length or finish reason")
    try:
        head = _loads(bytes(data[_PREFIX.size + numbers.size : start]).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidTrajectory(f"columnar payload: header is not JSON ({e})") from None
    _check_header(head, g)
    total_c, total_p = sum(n_completion), sum(n_prompt)
    expected = start + total_c * _BYTES_PER_COMPLETION_TOKEN + total_p * TOKEN_DTYPE.itemsize
    if len(data) != expected:
        raise InvalidTrajectory(f"columnar payload has {len(data)} bytes, its header describes {expected}")
    views = _views(data, start, total_c, total_p)
    bounds_c = list(zip([0, *accumulate(n_completion)], accumulate(n_completion), strict=False))
    bounds_p = list(zip([0, *accumulate(n_prompt)], accumulate(n_prompt), strict=False))
    cut = {
        name: [v[a:b] for a, b in (bounds_p if counted == "np" else bounds_c)]
        for (name, _, counted), v in zip(_COLUMNS, views.values(), strict=True)
    }
    gid = head["g"]
    # Positional, through one C-level ``map``: keyword construction in a Python loop cost as much as the
    # rest of the decode. The argument order is ``_FIELDS``, checked against the dataclass at import.
    trajectories = list(
        map(
            TrajectoryData,
            cut["prompt_token_ids"],
            cut["completion_token_ids"],
            cut["behavior_logprobs"],
            cut["policy_versions"],
            cut["loss_mask"],
            rewards,
            head["rc"],
            reasons,
            head["id"],
            repeat(gid, g),
            head["s"],
            head["ls"],
            head["tm"],
            started,
            finished,
        )
    )
    oldest = _check_columns(views, trajectories)
    return GroupData(group_id=gid, trajectories=trajectories, prompt_id=head["p"], metadata=head["m"]), oldest


def _read_prefix(data: bytes) -> tuple[int, int]:
    """``(G, H)`` from the payload's fixed prefix: its magic, version and group size checked."""
    if data[:3] != MAGIC:
        raise InvalidTrajectory(f"not a columnar trajectory group (starts with {bytes(data[:4])!r})")
    if len(data) < _PREFIX.size:
        raise InvalidTrajectory(f"columnar payload of {len(data)} bytes is shorter than its {_PREFIX.size}-byte prefix")
    _, version, g, hlen, _ = _PREFIX.unpack_from(data)
    if version != VERSION:
        raise InvalidTrajectory(
            f"columnar payload version {version}; this reader knows version {VERSION} — "
            "upgrade the learner to read entries written by newer rollout servers"
        )
    if not 0 < g <= _MAX_GROUP:
        raise InvalidTrajectory(f"columnar payload: a group of {g} trajectories (1 to {_MAX_GROUP} allowed)")
    return g, hlen
