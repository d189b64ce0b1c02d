"""The one way a rollout server turns generated tokens into a :class:`~tether.trajectory.TrajectoryData`.

The prompt worker (one completion of a group) and the episode store (a multi-turn episode) record the same
facts — token ids, behaviour log-probs, the policy version of each token, the loss mask, who made it and
at which sampling temperature (which the learner needs to score the same distribution) — so both build
them here, and a field added to the trajectory contract is filled in one place.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from tether.trajectory import (
    LOGPROB_DTYPE,
    MASK_DTYPE,
    TEMPERATURE_KEY,
    TOKEN_DTYPE,
    VERSION_DTYPE,
    TrajectoryData,
)


def build_trajectory(
    *,
    trajectory_id: str,
    group_id: str,
    prompt_ids: Sequence[int],
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    versions: Sequence[int],
    loss_mask: Sequence[int] | None = None,
    finish_reason: int,
    server_id: str,
    logprob_source: str,
    temperature: float,
    started_at: float,
    reward: float = 0.0,
    reward_components: Mapping[str, float] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> TrajectoryData:
    """A trajectory finished now. ``loss_mask`` None trains on every completion token; ``metadata`` is
    extended with the sampling temperature."""
    n = len(token_ids)
    return TrajectoryData(
        prompt_token_ids=np.asarray(prompt_ids, TOKEN_DTYPE),
        completion_token_ids=np.asarray(token_ids, TOKEN_DTYPE),
        behavior_logprobs=np.asarray(logprobs, LOGPROB_DTYPE),
        policy_versions=np.asarray(versions, VERSION_DTYPE),
        loss_mask=np.ones(n, MASK_DTYPE) if loss_mask is None else np.asarray(loss_mask, MASK_DTYPE),
        reward=float(reward),
        reward_components=dict(reward_components or {}),
        finish_reason=finish_reason,
        id=trajectory_id,
        group_id=group_id,
        server_id=server_id,
        logprob_source=logprob_source,
        metadata={**(metadata or {}), TEMPERATURE_KEY: repr(temperature)},
        started_at=started_at,
        finished_at=time.time(),
    )
