"""From buffer groups to training samples, and the step's groups from rank 0 to every rank.

Bad input is skipped, counted and logged, never trained on: a trajectory that ended aborted (partial
tokens, never scored), with a non-finite reward or behaviour log-prob, without prompt tokens (its first
token has no logits), without completion tokens, or with an unreadable sampling temperature. A fully
masked trajectory (no token to train on) is kept as a sample and counted as ``fully_masked``: as in verl, it
counts in its group's baseline and in the sequence count of the seq-mean loss aggregations, and adds no
token to the loss. Two
counts say where a group carries no relative signal: ``single_sample_groups`` (a group left with one sample:
verl's estimators give it its raw reward, see ``docs/ALGORITHMS.md``) and ``zero_std_groups`` (rewards all
equal, advantage 0: TRL's ``frac_reward_zero_std``; it rises as a run converges, or collapses onto one
answer per prompt under a 0/1 reward). The advantages themselves are computed in one place, by the
configured estimator over the samples (:func:`learner.advantages.assign_advantages`).

Each sample carries the temperature its tokens were sampled at (trajectory metadata
:data:`~tether.trajectory.TEMPERATURE_KEY`, else ``default_temperature``, the config's
``rollout.temperature``) so the learner scores the same processed distribution as the sampler. Raw
log-probs (``logprob_source`` other than ``processed``) are of the T = 1 distribution, so those
samples are scored at T = 1.

A sample's staleness is :func:`buffer.staleness_of` of its own oldest token, the formula the buffer's
reader drops and books groups by, so the two never disagree on the same tokens.

Rank 0 sends the groups in one uint8 tensor (plus an int64 header of lengths) in the one codec a group
travels in, the columnar payload of :mod:`buffer.columnar`: the very bytes the buffer's reader fetched
(:attr:`buffer.BufferedGroup.columnar`, inflated if they were compressed), so nothing is encoded again;
only a group that comes without them (a caller's own group) is encoded here, in the same codec. The
other ranks decode them into numpy views of the received bytes — ``broadcast_object_list`` would pickle,
and no pickle crosses a process boundary here.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist

from buffer.columnar import MAGIC, decode_columnar, encode_columnar
from buffer.policy import staleness_of
from learner.packing import Sample
from tether.logs import get_logger
from tether.trajectory import (
    LOGPROB_PROCESSED,
    TEMPERATURE_KEY,
    GroupData,
    TrajectoryData,
    logprob_temperature,
)
from tether.v1.trajectory_pb2 import FINISH_REASON_ABORTED

log = get_logger(__name__)

# Counts ``build_samples`` returns that are not skipped trajectories: in the step, but with no signal.
NOT_SKIPPED = ("fully_masked", "single_sample_groups", "zero_std_groups")


def zero_std_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> int:
    """Groups of two or more samples whose rewards are all equal (rewards, group_ids: [S]): their
    advantages are all 0, so they add nothing to the gradient (DAPO's dynamic sampling drops them)."""
    n = int(group_ids.max()) + 1
    lo = torch.full((n,), math.inf, dtype=rewards.dtype).scatter_reduce(0, group_ids, rewards, "amin")
    hi = torch.full((n,), -math.inf, dtype=rewards.dtype).scatter_reduce(0, group_ids, rewards, "amax")
    size = torch.zeros(n, dtype=torch.int64).index_add_(0, group_ids, torch.ones_like(group_ids))
    return int(((lo == hi) & (size > 1)).sum())


def sample_temperature(t: TrajectoryData, default: float) -> float | None:
    """The temperature to score ``t``'s log-probs at; None when its recorded one is unreadable."""
    if t.logprob_source != LOGPROB_PROCESSED:
        return 1.0
    raw = t.metadata.get(TEMPERATURE_KEY)
    try:
        value = default if raw is None else float(raw)
    except ValueError:
        return None
    return logprob_temperature(value) if math.isfinite(value) and value >= 0 else None


def build_samples(
    groups: list[GroupData],
    *,
    current_version: int,
    max_len: int | None = None,
    default_temperature: float = 1.0,
) -> tuple[list[Sample], Counter[str]]:
    """Samples (one per usable trajectory, fully masked ones included; no advantages yet) and counts of
    what was skipped and why (plus ``fully_masked``, ``single_sample_groups`` and ``zero_std_groups``)."""
    skipped: Counter[str] = Counter()
    kept: list[tuple[int, int, object, float]] = []
    for gi, g in enumerate(groups):
        for ti, t in enumerate(g.trajectories):
            temperature = sample_temperature(t, default_temperature)
            if reason := _skip_reason(t, temperature, max_len):
                skipped[reason] += 1
                continue
            kept.append((gi, ti, t, temperature))
    if not kept:
        _warn(skipped)
        return [], skipped
    rewards = torch.tensor([t.reward for _, _, t, _ in kept], dtype=torch.float64)
    gids = torch.tensor([gi for gi, _, _, _ in kept])
    _, dense, sizes = torch.unique(gids, return_inverse=True, return_counts=True)
    if n_single := int((sizes == 1).sum()):
        skipped["single_sample_groups"] = n_single
    if n_flat := zero_std_groups(rewards, dense):
        skipped["zero_std_groups"] = n_flat
    samples = []
    for gi, ti, t, temperature in kept:
        if not t.loss_mask.any():
            skipped["fully_masked"] += 1
        samples.append(
            Sample(
                input_ids=np.concatenate([t.prompt_token_ids, t.completion_token_ids]).astype(np.int64),
                prompt_len=int(t.prompt_token_ids.shape[0]),
                behavior_logprobs=np.asarray(t.behavior_logprobs, dtype=np.float32),
                loss_mask=np.asarray(t.loss_mask, dtype=np.float32),
                reward=float(t.reward),
                group=gi,
                trajectory=ti,
                staleness=staleness_of(t.oldest_version, current_version),
                temperature=temperature,
            )
        )
    _warn(skipped)
    return samples, skipped


def _skip_reason(t: TrajectoryData, temperature: float | None, max_len: int | None) -> str | None:
    """Why ``t`` cannot be trained on (None: it can); ``temperature`` is :func:`sample_temperature`'s."""
    if t.finish_reason == FINISH_REASON_ABORTED:
        return "aborted"
    if temperature is None:
        return "bad_temperature"
    if not math.isfinite(t.reward):
        return "nonfinite_reward"
    if t.num_completion_tokens == 0:
        return "empty_completion"
    if t.prompt_token_ids.shape[0] == 0:
        return "empty_prompt"
    if not np.isfinite(t.behavior_logprobs).all():
        return "nonfinite_logprob"
    if max_len is not None and t.prompt_token_ids.shape[0] + t.num_completion_tokens > max_len:
        return "too_long"
    return None


def _warn(skipped: Counter[str]) -> None:
    if any(k not in NOT_SKIPPED for k in skipped):
        log.warning("trajectories_skipped", **dict(skipped))


def pack_groups(
    groups: list[GroupData], *, payloads: list[bytes] | None = None, stop: int = 0
) -> tuple[torch.Tensor, bytearray]:
    """Rank ``src``'s side of :func:`broadcast_groups`: an int64 header ``[stop, n, len_1 … len_n]`` and the
    groups' columnar payloads end to end (writable, so ``torch.frombuffer`` shares it rather than copying).

    ``payloads[i]``, when given and not empty, is ``groups[i]``'s columnar payload as read from the buffer,
    sent as it is; a group without one is encoded here. Bytes of another codec are refused, not forwarded.
    """
    if payloads is None:
        payloads = [b""] * len(groups)
    if len(payloads) != len(groups):
        raise ValueError(f"{len(payloads)} payloads for {len(groups)} groups")
    parts = []
    for g, p in zip(groups, payloads, strict=True):
        if p and p[:3] != MAGIC:
            raise ValueError(f"group {g.group_id}: payload starts {bytes(p[:4])!r}, not a columnar group")
        parts.append(p or encode_columnar(g)[0])
    header = torch.tensor([int(stop), len(parts), *map(len, parts)], dtype=torch.int64)
    return header, bytearray().join(parts)


def unpack_groups(header: torch.Tensor, data: bytes) -> tuple[list[GroupData], int]:
    """The other ranks' side: the groups (validated; arrays are read-only views into ``data``) and the stop
    code."""
    stop, n = int(header[0]), int(header[1])
    view = memoryview(data)  # slices of it share the bytes: no copy per group
    out, offset = [], 0
    for length in header[2 : 2 + n].tolist():
        out.append(decode_columnar(view[offset : offset + length])[0])
        offset += length
    return out, stop


def broadcast_groups(
    groups: list[GroupData] | None,
    *,
    payloads: list[bytes] | None = None,
    src: int = 0,
    device: torch.device,
    stop: int = 0,
) -> tuple[list[GroupData], int]:
    """Rank ``src`` passes its groups, their columnar payloads as read when it has them (see
    :func:`pack_groups`), and a stop code (0 go on, any other value says why to stop); every rank returns
    the same groups and code (rank ``src`` its own, as passed)."""
    if dist.get_world_size() == 1:  # no other rank: nothing to encode or send
        return list(groups or []), int(stop)
    rank = dist.get_rank()
    if rank == src:
        header, raw = pack_groups(list(groups or []), payloads=payloads, stop=stop)
        size = torch.tensor([header.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    if rank != src:
        header = torch.zeros(int(size.item()), dtype=torch.int64)
    header_dev = header.to(device)
    dist.broadcast(header_dev, src)
    header = header_dev.cpu()
    total = int(header[2:].sum())
    if rank == src:
        blob = (torch.frombuffer(raw, dtype=torch.uint8) if total else torch.zeros(0, dtype=torch.uint8)).to(device)
    else:
        blob = torch.empty(total, dtype=torch.uint8, device=device)
    if total:
        dist.broadcast(blob, src)
    if rank == src:
        return list(groups or []), int(header[0])
    return unpack_groups(header, blob.cpu().numpy().tobytes())
