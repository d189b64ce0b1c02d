"""Trajectories as numpy arrays, with the length checks every consumer relies on.

This module is the one place that knows the per-token arrays' dtypes; :mod:`buffer.columnar` lays a group
out on the wire in them. :func:`validate` holds the contract of one trajectory: the buffer's codec refuses
a group that breaks it (raising :class:`InvalidTrajectory` with its message, and the buffer's reader
dead-letters such an entry) instead of letting it fail deep inside the learner.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import numpy as np

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
