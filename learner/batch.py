"""From buffer groups to training samples, and the step's groups from rank 0 to every rank.

Bad input is skipped, counted and logged, never trained on: a trajectory with a non-finite reward or
behaviour log-prob, without prompt tokens (its first token has no logits) or without completion
tokens; a fully masked trajectory still counts in its group's baseline but has nothing to train on.
Advantages are computed per group over the surviving rewards (GRPO / Dr.GRPO).

Rank 0 sends the groups as their protobuf encoding in one uint8 tensor (plus an int64 header of
lengths) — ``broadcast_object_list`` would pickle, and no pickle crosses a process boundary here.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist

from learner.losses import group_advantages
from learner.packing import Sample
from tether.logs import get_logger
from tether.trajectory import GroupData, decode_group, encode_group

log = get_logger(__name__)


def build_samples(
    groups: list[GroupData], *, current_version: int, norm_by_std: bool, max_len: int | None = None
) -> tuple[list[Sample], Counter[str]]:
    """Samples (one per usable trajectory) with advantages, and counts of what was skipped and why."""
    skipped: Counter[str] = Counter()
    kept: list[tuple[int, object]] = []
    for gi, g in enumerate(groups):
        for t in g.trajectories:
            reason = None
            if not math.isfinite(t.reward):
                reason = "nonfinite_reward"
            elif t.num_completion_tokens == 0:
                reason = "empty_completion"
            elif t.prompt_token_ids.shape[0] == 0:
                reason = "empty_prompt"
            elif not np.isfinite(t.behavior_logprobs).all():
                reason = "nonfinite_logprob"
            elif max_len is not None and t.prompt_token_ids.shape[0] + t.num_completion_tokens > max_len:
                reason = "too_long"
            if reason:
                skipped[reason] += 1
                continue
            kept.append((gi, t))
    if not kept:
        _warn(skipped)
        return [], skipped
    rewards = torch.tensor([t.reward for _, t in kept], dtype=torch.float64)
    gids = torch.tensor([gi for gi, _ in kept])
    _, dense = torch.unique(gids, return_inverse=True)
    adv = group_advantages(rewards, dense, norm_by_std=norm_by_std)
    samples = []
    for (gi, t), a in zip(kept, adv.tolist(), strict=True):
        if not t.loss_mask.any():
            skipped["fully_masked"] += 1
            continue
        samples.append(
            Sample(
                input_ids=np.concatenate([t.prompt_token_ids, t.completion_token_ids]).astype(np.int64),
                prompt_len=int(t.prompt_token_ids.shape[0]),
                behavior_logprobs=np.asarray(t.behavior_logprobs, dtype=np.float32),
                loss_mask=np.asarray(t.loss_mask, dtype=np.float32),
                advantage=a,
                reward=float(t.reward),
                group=gi,
                staleness=max(0, current_version - t.oldest_version),
            )
        )
    _warn(skipped)
    return samples, skipped


def _warn(skipped: Counter[str]) -> None:
    if skipped:
        log.warning("trajectories_skipped", **dict(skipped))


def broadcast_groups(
    groups: list[GroupData] | None, *, src: int = 0, device: torch.device, stop: int = 0
) -> tuple[list[GroupData], int]:
    """Rank ``src`` passes its groups (and a stop code: 0 go on, any other value says why to stop);
    every rank returns the same decoded groups and code."""
    rank = dist.get_rank()
    if rank == src:
        payloads = [encode_group(g) for g in groups or []]
        header = torch.tensor([int(stop), len(payloads), *map(len, payloads)], dtype=torch.int64)
        size = torch.tensor([header.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src)
    if rank != src:
        header = torch.zeros(int(size.item()), dtype=torch.int64)
    header_dev = header.to(device)
    dist.broadcast(header_dev, src)
    header = header_dev.cpu()
    stop_flag, n = int(header[0]), int(header[1])
    lengths = header[2 : 2 + n].tolist()
    total = sum(lengths)
    if rank == src:
        raw = bytearray(b"".join(payloads))
        blob = (torch.frombuffer(raw, dtype=torch.uint8) if total else torch.zeros(0, dtype=torch.uint8)).to(device)
    else:
        blob = torch.empty(total, dtype=torch.uint8, device=device)
    if total:
        dist.broadcast(blob, src)
    if rank == src:
        return list(groups or []), stop_flag
    data = blob.cpu().numpy().tobytes()
    out, offset = [], 0
    for length in lengths:
        out.append(decode_group(data[offset : offset + length]))
        offset += length
    return out, stop_flag
