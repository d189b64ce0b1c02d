"""Trajectories as numpy arrays and as protobuf, with the length checks every consumer relies on.

The per-token fields of ``tether.v1.Trajectory`` are raw little-endian arrays (see
``protos/tether/v1/trajectory.proto`` for why); this module is the one place that knows their dtypes.
``decode_group`` validates everything, so a malformed entry raises :class:`InvalidTrajectory` (and
the buffer dead-letters it) instead of failing deep inside the learner.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from google.protobuf import message as _pb_message

from tether.v1 import trajectory_pb2 as pb

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
VERSION_DTYPE = np.dtype("<i4")
MASK_DTYPE = np.dtype("u1")
# Policy versions travel as int64 on the wire but are stored per token as VERSION_DTYPE.
MAX_POLICY_VERSION = int(np.iinfo(VERSION_DTYPE).max)

# Behaviour log-probs of the sampler's processed distribution (temperature applied); "raw" ones are of
# the model's T = 1 distribution whatever the temperature.
LOGPROB_PROCESSED = "processed"
# Group ids of groups born from a prompt the learner issued on the prompts stream. Only their stale drops
# give an admission slot back (buffer.reader counts the others, custom environments' episode groups, as
# ``dropped_stale_env``), so the prefix is reserved: episodes may not use it.
PROMPT_GROUP_PREFIX = "prompt-"
# Trajectory metadata key: the temperature the completion tokens were sampled at (a float as text).
TEMPERATURE_KEY = "sampling_temperature"


def logprob_temperature(temperature: float) -> float:
    """The temperature whose distribution a behaviour log-prob is of, and the learner divides logits by.

    Sampling at T > 0 draws from ``softmax(logits / T)``. Greedy decoding (T = 0) draws from no
    distribution at all; its log-probs are defined as those of T = 1 (what vLLM reports for greedy
    requests), so behaviour and learner still agree and the importance ratio at lag 0 is 1.
    """
    return float(temperature) if temperature > 0 else 1.0


class InvalidTrajectory(ValueError):
    """A trajectory or group that breaks the contract; the message says how."""


@dataclass
class TrajectoryData:
    """One sample in numpy form; ``completion_*`` arrays all have one element per completion token."""

    prompt_token_ids: np.ndarray
    completion_token_ids: np.ndarray
    behavior_logprobs: np.ndarray
    policy_versions: np.ndarray
    loss_mask: np.ndarray
    reward: float = 0.0
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: int = pb.FINISH_REASON_UNSPECIFIED
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    group_id: str = ""
    server_id: str = ""
    logprob_source: str = "raw"
    metadata: dict[str, str] = field(default_factory=dict)
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_token_ids.shape[0])

    @property
    def oldest_version(self) -> int:
        return int(self.policy_versions.min()) if self.policy_versions.size else -1


def _as(arr: Sequence[float] | np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(arr), dtype=dtype)


def to_proto(t: TrajectoryData) -> pb.Trajectory:
    msg = pb.Trajectory(
        id=t.id,
        group_id=t.group_id,
        prompt_token_ids=_as(t.prompt_token_ids, TOKEN_DTYPE).tobytes(),
        completion_token_ids=_as(t.completion_token_ids, TOKEN_DTYPE).tobytes(),
        behavior_logprobs=_as(t.behavior_logprobs, LOGPROB_DTYPE).tobytes(),
        policy_versions=_as(t.policy_versions, VERSION_DTYPE).tobytes(),
        loss_mask=_as(t.loss_mask, MASK_DTYPE).tobytes(),
        reward=float(t.reward),
        reward_components=t.reward_components,
        finish_reason=t.finish_reason,
        server_id=t.server_id,
        metadata=t.metadata,
        logprob_source=t.logprob_source,
    )
    if t.started_at:
        msg.started_at.FromNanoseconds(int(t.started_at * 1e9))
    if t.finished_at:
        msg.finished_at.FromNanoseconds(int(t.finished_at * 1e9))
    return msg


def _array(buf: bytes, dtype: np.dtype, name: str, tid: str) -> np.ndarray:
    if len(buf) % dtype.itemsize:
        raise InvalidTrajectory(f"trajectory {tid}: {name} has {len(buf)} bytes, not a multiple of {dtype.itemsize}")
    return np.frombuffer(buf, dtype=dtype)


def from_proto(msg: pb.Trajectory) -> TrajectoryData:
    """Numpy views over the message's bytes (read-only, no copy), validated."""
    tid = msg.id or "<no id>"
    t = TrajectoryData(
        prompt_token_ids=_array(msg.prompt_token_ids, TOKEN_DTYPE, "prompt_token_ids", tid),
        completion_token_ids=_array(msg.completion_token_ids, TOKEN_DTYPE, "completion_token_ids", tid),
        behavior_logprobs=_array(msg.behavior_logprobs, LOGPROB_DTYPE, "behavior_logprobs", tid),
        policy_versions=_array(msg.policy_versions, VERSION_DTYPE, "policy_versions", tid),
        loss_mask=_array(msg.loss_mask, MASK_DTYPE, "loss_mask", tid),
        reward=msg.reward,
        reward_components=dict(msg.reward_components),
        finish_reason=msg.finish_reason,
        id=msg.id,
        group_id=msg.group_id,
        server_id=msg.server_id,
        logprob_source=msg.logprob_source,
        metadata=dict(msg.metadata),
        started_at=msg.started_at.ToNanoseconds() / 1e9 if msg.HasField("started_at") else 0.0,
        finished_at=msg.finished_at.ToNanoseconds() / 1e9 if msg.HasField("finished_at") else 0.0,
    )
    validate(t)
    return t


def validate(t: TrajectoryData) -> None:
    tid = t.id or "<no id>"
    if not t.id:
        raise InvalidTrajectory("trajectory has no id")
    n = t.num_completion_tokens
    for name in ("behavior_logprobs", "policy_versions", "loss_mask"):
        got = getattr(t, name).shape[0]
        if got != n:
            raise InvalidTrajectory(f"trajectory {tid}: {name} has {got} elements for {n} completion tokens")
    if (t.prompt_token_ids.size and t.prompt_token_ids.min() < 0) or (n and t.completion_token_ids.min() < 0):
        raise InvalidTrajectory(f"trajectory {tid}: negative token id")
    if n and (t.loss_mask > 1).any():
        raise InvalidTrajectory(f"trajectory {tid}: loss_mask values must be 0 or 1")
    if n and t.policy_versions.min() < 0:
        raise InvalidTrajectory(f"trajectory {tid}: negative policy version")


# Below this many elements per kind, one concatenate and one reduction over the whole group is cheaper than
# a reduction per array: numpy's per-call overhead (~1-3 µs) dwarfs copying a few hundred KB.
_CONCAT_MAX_ELEMENTS = 1 << 15


def _group_reduce(op: np.ufunc, arrays: list[np.ndarray], total: int) -> int | None:
    arrays = [a for a in arrays if a.shape[0]]
    if not arrays:
        return None
    if len(arrays) == 1 or total > _CONCAT_MAX_ELEMENTS:
        return int(op.reduce([op.reduce(a) for a in arrays]))
    return int(op.reduce(np.concatenate(arrays)))


def validate_group(trajectories: Sequence[TrajectoryData]) -> int:
    """:func:`validate` every trajectory of a group at once; returns the group's oldest policy version (-1
    when it has no completion tokens).

    The checks run vectorised over the whole group (a handful of numpy calls instead of ~5 per
    trajectory). When any fails, the trajectories are re-validated one by one, so the error raised is
    exactly the one :func:`validate` in order would raise.
    """
    prompts, completions, masks, versions = [], [], [], []
    n_tokens = n_versions = 0
    for t in trajectories:
        n = t.completion_token_ids.shape[0]
        if (
            not t.id
            or t.behavior_logprobs.shape[0] != n
            or t.policy_versions.shape[0] != n
            or t.loss_mask.shape[0] != n
        ):
            break
        prompts.append(t.prompt_token_ids)
        completions.append(t.completion_token_ids)
        masks.append(t.loss_mask)
        versions.append(t.policy_versions)
        n_tokens += t.prompt_token_ids.shape[0] + n
        n_versions += n
    else:
        lowest_token = _group_reduce(np.minimum, prompts + completions, n_tokens)
        highest_mask = _group_reduce(np.maximum, masks, n_versions)
        oldest = _group_reduce(np.minimum, versions, n_versions)
        if (
            (lowest_token is None or lowest_token >= 0)
            and (highest_mask is None or highest_mask <= 1)
            and (oldest is None or oldest >= 0)
        ):
            return -1 if oldest is None else oldest
    for t in trajectories:
        validate(t)
    raise InvalidTrajectory("trajectory group failed validation")  # not reached: validate raises first


@dataclass
class GroupData:
    group_id: str
    trajectories: list[TrajectoryData]
    prompt_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        versions = [t.oldest_version for t in self.trajectories if t.num_completion_tokens]
        return min(versions) if versions else -1

    @property
    def num_tokens(self) -> int:
        return sum(t.prompt_token_ids.shape[0] + t.num_completion_tokens for t in self.trajectories)

    def rewards(self) -> np.ndarray:
        return np.array([t.reward for t in self.trajectories], dtype=np.float64)


def encode_group(g: GroupData) -> bytes:
    msg = pb.TrajectoryGroup(group_id=g.group_id, prompt_id=g.prompt_id, metadata=g.metadata)
    for t in g.trajectories:
        if not t.group_id:
            t.group_id = g.group_id
        validate(t)
        msg.trajectories.append(to_proto(t))
    # Deterministic: map entries sorted by key. Otherwise protobuf writes a map in its hash table's order,
    # which differs between processes, and one group would have several encodings.
    return msg.SerializeToString(deterministic=True)


def decode_group(data: bytes) -> GroupData:
    """Parse and validate one ``TrajectoryGroup``; raises :class:`InvalidTrajectory` on anything wrong."""
    msg = pb.TrajectoryGroup()
    try:
        msg.ParseFromString(data)
    except (_pb_message.DecodeError, ValueError, TypeError) as e:
        raise InvalidTrajectory(f"not a TrajectoryGroup protobuf: {e}") from None
    if not msg.group_id:
        raise InvalidTrajectory("trajectory group has no group_id")
    if not msg.trajectories:
        raise InvalidTrajectory(f"trajectory group {msg.group_id} is empty")
    trajectories = [from_proto(t) for t in msg.trajectories]
    for t in trajectories:
        if t.group_id != msg.group_id:
            raise InvalidTrajectory(f"trajectory {t.id} has group_id {t.group_id!r}, its group is {msg.group_id!r}")
    return GroupData(
        group_id=msg.group_id, trajectories=trajectories, prompt_id=msg.prompt_id, metadata=dict(msg.metadata)
    )
