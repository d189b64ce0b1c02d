"""Ulysses sequence parallelism: one packed row split over the SP ranks of a group, heads exchanged at attention.

``learner.ulysses_sequence_parallel_size = SP`` cuts the W learner ranks into W/SP groups of SP
consecutive ranks. A group trains one micro-batch together: the packed row (``use_remove_padding``) is
padded to a multiple of SP and each rank holds a contiguous 1/SP of its tokens through the embedding,
the MLPs, the norms and the LM head, so activations per rank shrink by SP. Attention needs whole
sequences, so around it an all-to-all turns ``[1, H, T/SP, D]`` (all heads, a slice of tokens) into
``[1, H/SP, T, D]`` (a slice of heads, all tokens), the varlen kernel runs with the full row's
``cu_seqlens``, and the inverse all-to-all brings the output back to sequence shards (DeepSpeed-Ulysses;
verl's ``ulysses_sequence_parallel_size``). The all-to-all's backward is the inverse all-to-all.

Rotary embeddings need no exchange: each rank keeps its tokens' position ids. The log-probs each rank
scores are all-gathered in row order, so every rank of a group computes the same loss; the gather's
backward keeps only the rank's own slice, so each token's gradient is counted once and FSDP's average
over all W ranks (the loss is scaled by W, as without SP) is the gradient of SP = 1. FSDP still shards
over all W ranks: SP changes what a rank computes on, not what it stores.

The attention function is registered with transformers under :data:`ULYSSES` and finds its group in
this module (transformers calls it with no room for one); :func:`setup` sets it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from learner import varlen_attention

ULYSSES = "tether_ulysses"
"""The ``attn_implementation`` name this module registers."""

_GROUP: dist.ProcessGroup | None = None
_INNER = varlen_attention.varlen_attention_forward


@dataclass(frozen=True)
class Layout:
    """Where this rank sits: its SP group (``sp`` ranks) and its data-parallel index among W/SP groups."""

    sp: int
    sp_rank: int
    dp: int
    dp_rank: int
    group: dist.ProcessGroup | None


def setup(sp: int, *, num_heads: int) -> Layout:
    """Collective: build the SP groups (ranks ``[g*sp, (g+1)*sp)``) and install this rank's for attention."""
    global _GROUP
    rank, world = dist.get_rank(), dist.get_world_size()
    if sp == 1:
        return Layout(sp=1, sp_rank=0, dp=world, dp_rank=rank, group=None)
    if world % sp:
        raise ValueError(f"learner.ulysses_sequence_parallel_size ({sp}) must divide the learner world size ({world})")
    if num_heads % sp:
        raise ValueError(
            f"learner.ulysses_sequence_parallel_size ({sp}) must divide the model's attention heads ({num_heads})"
        )
    mine = None
    for g in range(world // sp):
        group = dist.new_group(list(range(g * sp, (g + 1) * sp)))  # every rank creates every group
        if rank // sp == g:
            mine = group
    _GROUP = mine
    return Layout(sp=sp, sp_rank=rank % sp, dp=world // sp, dp_rank=rank // sp, group=mine)


def register(inner: str) -> str:
    """Register the Ulysses attention around ``inner`` (``flash_attention_2``, or the CPU varlen kernel)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    global _INNER
    flash = inner == "flash_attention_2"
    _INNER = ALL_ATTENTION_FUNCTIONS[inner] if flash else varlen_attention.varlen_attention_forward
    AttentionInterface.register(ULYSSES, ulysses_attention_forward)
    return ULYSSES


def _all_to_all(x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> Tensor:
    sp = dist.get_world_size(group)
    send = torch.stack(x.chunk(sp, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, scatter_dim: int, gather_dim: int, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return _all_to_all(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[B, H, T/SP, D]`` -> ``[B, H/SP, T, D]``."""
    return _AllToAll.apply(x, 1, 2, group)


def heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``[B, T, H/SP, D]`` -> ``[B, T/SP, H, D]`` (the attention function's output layout)."""
    return _AllToAll.apply(x, 1, 2, group)


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention-function signature on sequence shards; returns ``([1, T/SP, H, D], None)``."""
    group = _GROUP
    if group is None:
        return _INNER(module, query, key, value, attention_mask, **kwargs)
    sp = dist.get_world_size(group)
    if key.shape[1] % sp:
        # Fewer KV heads than SP ranks: give every query head its own KV copy so the heads split evenly.
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    if kwargs.get("s_aux") is not None:
        # Attention sinks (gpt-oss) are one logit per query head: this rank attends with heads
        # [rank·H/SP, (rank+1)·H/SP) after the all-to-all (seq_to_heads chunks dim 1 in rank order).
        kwargs["s_aux"] = kwargs["s_aux"].chunk(sp)[dist.get_rank(group)]
    if "cu_seq_lens_q" not in kwargs:
        # A dummy forward (no boundaries given): the local position ids do not describe the gathered row.
        kwargs.pop("position_ids", None)
    out, _ = _INNER(module, q, k, v, attention_mask, **kwargs)
    return heads_to_seq(out, group), None


class _GatherRows(torch.autograd.Function):
    """All-gather of per-rank 1-D pieces of known lengths; backward keeps this rank's slice (the loss
    on the gathered tensor is the same on every rank of the group, so its gradient is too)."""

    @staticmethod
    def forward(ctx, x: Tensor, counts: list[int], rank: int, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.slice = (sum(counts[:rank]), counts[rank])
        width = max(counts)
        padded = torch.zeros(width, dtype=x.dtype, device=x.device)
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        start, n = ctx.slice
        return grad[start : start + n], None, None, None


@dataclass
class Shard:
    """This rank's piece of a packed micro-batch under SP."""

    input_ids: Tensor  # [1, T'/SP]
    position_ids: Tensor  # [1, T'/SP]
    logit_index: Tensor  # [n_local] positions in the local piece whose logits are needed
    local: Tensor  # [N] bool: which of the micro-batch's completion tokens this rank scores
    counts: list[int]  # completion tokens scored by each rank of the group
    lengths: list[int]  # the padded row's sequence lengths (the padding is a sequence of its own)


def shard_row(input_ids: Tensor, logit_index: Tensor, seq_lengths: list[int], layout: Layout, *, pad_id: int) -> Shard:
    """Cut a packed row ``[1, T]`` into ``layout.sp`` contiguous pieces, padded to equal length."""
    total = input_ids.shape[1]
    pad = -total % layout.sp
    lengths = [*seq_lengths, pad] if pad else list(seq_lengths)
    ids = torch.cat([input_ids, input_ids.new_full((1, pad), pad_id)], dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    width = ids.shape[1] // layout.sp
    start = layout.sp_rank * width
    owner = torch.div(logit_index, width, rounding_mode="floor")
    local = owner == layout.sp_rank
    counts = torch.bincount(owner, minlength=layout.sp).tolist()
    return Shard(
        input_ids=ids[:, start : start + width],
        position_ids=pos[:, start : start + width],
        logit_index=logit_index[local] - start,
        local=local,
        counts=counts,
        lengths=lengths,
    )


def gather_rows(x: Tensor, shard: Shard, layout: Layout) -> Tensor:
    """Per-token values of this rank's completion tokens -> the whole micro-batch's, in row order."""
    return _GatherRows.apply(x, shard.counts, layout.sp_rank, layout.group)
