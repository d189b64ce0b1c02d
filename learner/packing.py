"""Samples, micro-batch planning (fixed count or token budget, balanced across ranks), packing.

A :class:`Sample` is one trajectory ready to train on: prompt + completion token ids and the
completion-aligned arrays (behaviour log-probs, loss mask, ...). Logits at position ``i`` predict
token ``i + 1``, so completion token ``j`` is scored from position ``prompt_len - 1 + j``; only those
positions go through the LM head (``logits_to_keep``), which keeps the ``[tokens, vocab]`` tensor to
completion tokens.

``use_remove_padding`` packs a micro-batch into one row: position ids restart at 0 for every sequence,
no attention mask is passed, and the sequence lengths travel with the micro-batch so the forward can
hand the attention kernel its boundaries (``cu_seqlens``): flash-attention's varlen kernel on GPU,
:mod:`learner.varlen_attention` otherwise. No token attends across a sequence boundary, no compute is
spent on padding, and attention costs ``ΣL²`` rather than ``(ΣL)²``. Without it, sequences are
right-padded into ``[B, L]`` with an attention mask — the baseline the benchmark compares against.

Planning is deterministic from the lengths alone: every rank holds the whole step's samples (rank 0
broadcast them), computes the same plan and takes its share, so no extra collective is needed. All
ranks get the same number of micro-batches because FSDP's collectives must pair up; a rank with less
work runs empty micro-batches (a zero-weighted dummy forward).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from learner.attention_kernels import PromptTree


@dataclass
class Sample:
    """One trajectory. ``completion_*`` arrays have one entry per completion token."""

    input_ids: np.ndarray
    prompt_len: int
    behavior_logprobs: np.ndarray
    loss_mask: np.ndarray
    advantage: float | np.ndarray = 0.0  # one per sample, or one per completion token
    reward: float = 0.0
    group: int = 0
    trajectory: int = 0  # its index among its group's trajectories (the viewer's record matches on it)
    staleness: int = 0
    temperature: float = 1.0  # logits are divided by it before log-softmax (the sampler's distribution)
    proximal_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None
    values: np.ndarray | None = None  # the critic's, before the step (PPO with GAE)
    returns: np.ndarray | None = None  # the critic's targets, from the advantage estimator
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_completion(self) -> int:
        return int(self.input_ids.shape[0]) - self.prompt_len

    @property
    def num_trained(self) -> int:
        return int(self.loss_mask.sum())


@dataclass
class MicroBatch:
    """Model inputs of one micro-batch plus the flat per-completion-token layout the losses use."""

    input_ids: Tensor  # [B, L]
    position_ids: Tensor  # [B, L]
    attention_mask: Tensor | None  # [B, L] (padded layout only)
    logit_index: Tensor  # [N] flat index into B*L of the positions whose logits are needed
    targets: Tensor  # [N] the token each of those positions predicts
    seq_ids: Tensor  # [N] local sequence index 0..S-1
    sample_index: list[int]  # indices of this micro-batch's samples in the step's sample list
    packed: bool
    seq_lengths: list[int] = field(default_factory=list)  # tokens of each sequence (segment), in row order
    prompt_tree: PromptTree | None = None  # shared prompts (learner.share_prompts): the row's layout

    @property
    def empty(self) -> bool:
        return not self.sample_index

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel()) if self.attention_mask is None else int(self.attention_mask.sum())


def make_micro_batch(
    samples: list[Sample], index: list[int], *, packed: bool, pad_id: int = 0, share_prompts: bool = False
) -> MicroBatch:
    """Build the tensors of one micro-batch from ``samples[i] for i in index`` (empty: a 1-token dummy).

    Each field is assembled in NumPy and becomes a tensor once: at the demo size (64 short sequences) a
    tensor per sequence and field was a fifth of the step's host time. ``share_prompts`` (packed only):
    samples with the same prompt share one copy of it (:func:`shared_prompt_batch`).
    """
    chosen = [samples[i] for i in index]
    if not chosen:
        one = torch.full((1, 1), pad_id, dtype=torch.long)
        empty = torch.zeros(0, dtype=torch.long)
        return MicroBatch(one, torch.zeros_like(one), None, torch.zeros(1, dtype=torch.long), one[0], empty, [], packed)
    if packed and share_prompts:
        return shared_prompt_batch(chosen, index)
    lengths = [s.length for s in chosen]
    rows = [np.asarray(s.input_ids, dtype=np.int64) for s in chosen]
    width = sum(lengths) if packed else max(lengths)
    bases = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if packed else np.arange(len(chosen)) * width
    logit_index = np.concatenate(
        [np.arange(s.prompt_len - 1, s.length - 1) + b for s, b in zip(chosen, bases, strict=True)]
    )
    targets = np.concatenate([ids[s.prompt_len :] for s, ids in zip(chosen, rows, strict=True)])
    seq_ids = np.repeat(np.arange(len(chosen)), [s.num_completion for s in chosen])
    if packed:
        # np.concatenate copies, so the tensors never share the decoded (read-only) arrays.
        input_ids = torch.from_numpy(np.concatenate(rows))[None]
        position_ids = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]))[None]
        attention_mask = None
    else:
        ids = np.full((len(chosen), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(chosen), width), dtype=np.int64)
        for k, row in enumerate(rows):
            ids[k, : row.shape[0]] = row
            mask[k, : row.shape[0]] = 1
        input_ids, attention_mask = torch.from_numpy(ids), torch.from_numpy(mask)
        position_ids = torch.arange(width)[None].expand(len(chosen), -1).clone()
    return MicroBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        logit_index=torch.from_numpy(logit_index.astype(np.int64)),
        targets=torch.from_numpy(targets),
        seq_ids=torch.from_numpy(seq_ids.astype(np.int64)),
        sample_index=list(index),
        packed=packed,
        seq_lengths=lengths,
    )


def prompt_key(sample: Sample) -> bytes:
    """Samples with equal keys have the same prompt tokens."""
    return np.asarray(sample.input_ids[: sample.prompt_len], dtype=np.int64).tobytes()


def shared_prompt_batch(chosen: list[Sample], index: list[int]) -> MicroBatch:
    """One packed row in which samples with the same prompt share it: the prompt's tokens once, then each
    completion (position ids continuing from the prompt), as :data:`PromptTree` says; a prompt only one sample
    has stays a plain sequence. The per-token fields (``logit_index``, ``targets``, ``seq_ids``) keep the
    order of ``index`` as in :func:`make_micro_batch`: a completion's first token is scored from its prompt's
    last position, which its siblings' first tokens share."""
    members: dict[bytes, list[int]] = {}
    for k, s in enumerate(chosen):
        members.setdefault(prompt_key(s), []).append(k)
    ids, positions, tree = [], [], []
    first = np.zeros(len(chosen), dtype=np.int64)  # row position of each sample's first scored logit
    rest = np.zeros(len(chosen), dtype=np.int64)  # row position of each sample's first completion token
    at = 0
    for ks in members.values():
        s0 = chosen[ks[0]]
        p = s0.prompt_len
        shared = [k for k in ks if chosen[k].num_completion > 0]
        if len(ks) == 1 or not shared:  # nothing to share: plain sequences
            for k in ks:
                s = chosen[k]
                ids.append(np.asarray(s.input_ids, dtype=np.int64))
                positions.append(np.arange(s.length))
                tree.append((s.length, ()))
                first[k], rest[k] = at + p - 1, at + p
                at += s.length
            continue
        ids.append(np.asarray(s0.input_ids[:p], dtype=np.int64))
        positions.append(np.arange(p))
        prompt_end, at = at + p - 1, at + p
        lengths = []
        for k in ks:
            c = chosen[k].num_completion
            first[k], rest[k] = prompt_end, at
            if c:
                ids.append(np.asarray(chosen[k].input_ids[p:], dtype=np.int64))
                positions.append(np.arange(p, p + c))
                lengths.append(c)
                at += c
        tree.append((p, tuple(lengths)))
    logit_index = np.concatenate(
        [np.concatenate([[first[k]], rest[k] + np.arange(s.num_completion - 1)]) if s.num_completion else
         np.zeros(0, dtype=np.int64) for k, s in enumerate(chosen)]
    )  # fmt: skip
    targets = np.concatenate([np.asarray(s.input_ids[s.prompt_len :], dtype=np.int64) for s in chosen])
    seq_ids = np.repeat(np.arange(len(chosen)), [s.num_completion for s in chosen])
    return MicroBatch(
        input_ids=torch.from_numpy(np.concatenate(ids))[None],
        position_ids=torch.from_numpy(np.concatenate(positions))[None],
        attention_mask=None,
        logit_index=torch.from_numpy(logit_index.astype(np.int64)),
        targets=torch.from_numpy(targets),
        seq_ids=torch.from_numpy(seq_ids.astype(np.int64)),
        sample_index=list(index),
        packed=True,
        seq_lengths=[n for p, cs in tree for n in (p, *cs)],
        prompt_tree=tuple(tree),
    )


def row_tokens(samples: list[Sample], index: list[int], *, share_prompts: bool) -> int:
    """Tokens the model runs for ``samples[i] for i in index`` in one packed row: with ``share_prompts`` a
    prompt k samples share counts once instead of k times."""
    total = sum(samples[i].length for i in index)
    if share_prompts:
        seen: set[bytes] = set()
        for i in index:
            key = prompt_key(samples[i])
            if key in seen:
                total -= samples[i].prompt_len
            seen.add(key)
    return total


def shared_prompt_units(samples: list[Sample], index: list[int], budget: int) -> tuple[list[list[int]], list[int]]:
    """``index`` cut into units that keep a prompt's samples together (in order), each unit's tokens with
    its prompt once at most ``budget`` (a sample alone may exceed it): ``(units, tokens of each unit)``. The
    micro-batch planner packs units, so a GRPO group shares its prompt instead of being spread out."""
    by_prompt: dict[bytes, list[int]] = {}
    for i in index:
        by_prompt.setdefault(prompt_key(samples[i]), []).append(i)
    units: list[list[int]] = []
    costs: list[int] = []
    for members in by_prompt.values():
        p, first_unit = samples[members[0]].prompt_len, len(units)
        for i in members:
            c = samples[i].num_completion
            if len(units) > first_unit and costs[-1] + c <= budget:
                units[-1].append(i)
                costs[-1] += c
            else:
                units.append([i])
                costs.append(p + c)
    return units, costs


def per_token(samples: list[Sample], index: list[int], name: str) -> Tensor:
    """Concatenate a completion-aligned field (or broadcast a scalar one) over a micro-batch, as float32."""
    parts = []
    for i in index:
        s = samples[i]
        value = getattr(s, name)
        if value is None:
            raise ValueError(f"sample field {name!r} is not set")
        if np.ndim(value) == 0:
            parts.append(np.full(s.num_completion, value, dtype=np.float32))
        else:
            parts.append(np.asarray(value, dtype=np.float32))
    # np.concatenate copies: the tensor never shares a decoded (read-only) array.
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0)


def balance_ranks(lengths: list[int], world_size: int) -> list[list[int]]:
    """Split sample indices over ranks with near-equal token totals (longest first onto the lightest)."""
    heap = [(0, r) for r in range(world_size)]
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + lengths[i], r))
    return [sorted(x) for x in out]


def _fit_bins(items: list[int], lengths: list[int], n_bins: int, budget: int) -> list[list[int]] | None:
    """Longest-first onto the lightest of ``n_bins`` bins; None when a bin would pass ``budget``
    (a single sample longer than the budget is allowed alone in its bin)."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        b = min(range(n_bins), key=lambda k: (loads[k], k))
        if loads[b] and loads[b] + lengths[i] > budget:
            return None
        bins[b].append(i)
        loads[b] += lengths[i]
    return [sorted(b) for b in bins]


def _padded_bins(items: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    """Padded micro-batches: samples in order of length, each batch as many as fit ``budget`` padded
    slots (rows x its longest row); a sample longer than the budget alone. Like lengths share a batch,
    so little is padded; balancing loads (:func:`_fit_bins`) would put a long sample in every batch
    and pad every short one to it."""
    bins: list[list[int]] = []
    for i in sorted(items, key=lambda i: (lengths[i], i)):
        if bins and lengths[i] * (len(bins[-1]) + 1) <= budget:  # sorted: the newcomer is the longest
            bins[-1].append(i)
        else:
            bins.append([i])
    return bins


def _equal_counts(chunks: list[list[list[int]]]) -> list[list[list[int]]]:
    """Each rank's micro-batches, empty ones appended so that every rank runs as many."""
    n = max((len(c) for c in chunks), default=0)
    return [c + [[] for _ in range(n - len(c))] for c in chunks]


def plan_micro_batches(
    lengths: list[int],
    *,
    world_size: int,
    dynamic: bool,
    max_tokens: int,
    micro_batch_size: int,
    padded: bool = False,
) -> list[list[list[int]]]:
    """``plan[rank][k]`` = sample indices of rank's k-th micro-batch; every rank has the same count.

    Samples are first balanced over ranks by tokens, then cut into micro-batches by
    :func:`plan_within_ranks`. Every sample appears exactly once in the whole plan.
    """
    per_rank = balance_ranks(lengths, world_size)
    return plan_within_ranks(
        per_rank, lengths, dynamic=dynamic, max_tokens=max_tokens, micro_batch_size=micro_batch_size, padded=padded
    )


def plan_within_ranks(
    per_rank: list[list[int]],
    lengths: list[int],
    *,
    dynamic: bool,
    max_tokens: int,
    micro_batch_size: int,
    padded: bool = False,
) -> list[list[list[int]]]:
    """Cut each rank's samples into micro-batches, the same number on every rank (padded with empties).

    dynamic: at most ``max_tokens`` tokens each (one over-long sample alone is allowed), as few
    micro-batches as the busiest rank needs; ``padded`` (no remove-padding): at most ``max_tokens``
    padded slots each, like lengths together (:func:`_padded_bins`). Otherwise: ``micro_batch_size``
    samples each.
    """
    if not dynamic:
        return _equal_counts(
            [[idx[k : k + micro_batch_size] for k in range(0, len(idx), micro_batch_size)] for idx in per_rank]
        )
    if padded:
        return _equal_counts([_padded_bins(idx, lengths, max_tokens) for idx in per_rank])
    need = max((-(-sum(lengths[i] for i in idx) // max_tokens) for idx in per_rank), default=0)
    n = max(need, 1 if any(per_rank) else 0)
    while True:
        plans = [_fit_bins(idx, lengths, n, max_tokens) for idx in per_rank]
        if all(p is not None for p in plans):
            # Empty bins go last so the dummies run after the real work.
            return [sorted(p, key=lambda b: not b) for p in plans]  # type: ignore[union-attr]
        n += 1
