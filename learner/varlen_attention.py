"""Varlen attention for packed rows without flash-attn: each sequence attends only within itself.

A packed row (``use_remove_padding``) holds several sequences one after the other, with position ids
restarting at 0 for each. With ``sdpa`` or ``eager``, transformers turns that into one block-diagonal
causal mask of ``(ΣL)²`` entries and runs attention over the whole row, so attention costs
``O((ΣL)²)`` instead of ``ΣL²`` and a budget of 8k tokens materialises a 64M-entry mask per forward —
packing then loses to padding. flash-attn's ``flash_attn_varlen_func`` avoids both on GPU; this module
is the same idea for CPU (and GPU without flash-attn): split the row at the sequence boundaries
(``cu_seqlens``) and run ``scaled_dot_product_attention(is_causal=True)`` on each sequence.

It is registered with transformers' ``AttentionInterface`` under :data:`VARLEN`. That name has no entry
in transformers' mask interface, so the model skips mask creation entirely (no ``(ΣL)²`` tensor is
ever built) and hands ``attention_mask=None`` to :func:`varlen_attention_forward`. The boundaries come
from the flash-attention kwargs (``cu_seq_lens_q``) when the caller passes them — the learner computes
them once per micro-batch in :func:`cu_seqlens_kwargs` — or else from where ``position_ids`` restart.

It also does not depend on transformers noticing the packing: transformers only looks for restarting
position ids when no KV cache is passed, and with one (``use_cache`` left on) sdpa silently attends
across sequence boundaries; here the boundaries are explicit.

Splitting uses one ``torch.split`` and one ``torch.cat`` so backward is one gather/scatter, not one
full-size zero tensor per sequence. GQA runs through sdpa's ``enable_gqa`` (no ``repeat_kv`` copy).

Two kernels sit behind one interface (``learner.varlen_attention``): ``split`` (the above, anywhere) and
``torch`` (:data:`VARLEN_TORCH`: ``torch.nn.attention.varlen.varlen_attn``, torch ≥ 2.10's flash kernel
for packed rows — one launch per layer for the whole micro-batch, CUDA only, no flash-attn wheel).

The lengths never come from the device: :func:`cu_seqlens_kwargs` records each micro-batch's lengths
beside its ``cu_seqlens`` tensor (:func:`host_lengths`), so no layer calls ``.tolist()`` on a CUDA tensor
— that was one host sync per layer per forward (and again in the recompute of checkpointed blocks).

Three per-layer variants transformers hands the attention function, so Gemma 2/3, Mistral and gpt-oss
train on packed rows with the defaults (:func:`attend`):

* ``sliding_window=W`` (Mistral on every layer; Gemma, Qwen, gpt-oss on their ``"sliding_attention"``
  ``layer_types``): the query at position ``i`` sees keys ``j`` with ``0 <= i - j < W`` — transformers'
  ``sliding_window_overlay`` (``kv_idx > q_idx - W``) and flash-attn's ``window_size=(W - 1, 0)``. A
  sequence no longer than ``W`` is plain causal and stays on the fast path; a longer one runs sdpa with a
  ``[L, L]`` boolean mask of its own (never one of the row).
* ``softcap`` (Gemma 2): scores become ``tanh(s / cap) · cap`` before the mask. sdpa has no softcap, so
  those layers compute attention explicitly (matmul, cap, mask, float32 softmax, matmul), per sequence.
* ``s_aux`` (gpt-oss's ``sinks``): one learned logit per head joins each query's softmax denominator and
  contributes no value — explicit math as well, so the sinks get their gradient.

The explicit path holds ``[H, L, L]`` scores per sequence (eager attention's cost, never the row's
``(ΣL)²``). torch's varlen kernel takes the window (``window_size`` in torch > 2.10); softcap, sinks, or a
window on a torch without ``window_size`` fall back to the split kernel — slower, never wrong.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import weakref

import numpy as np
import torch
import torch.nn.functional as F  # noqa: F401 (tests count the sdpa calls through this name)
from torch import Tensor

from learner.attention_kernels import (  # noqa: F401 (the kernels' home before; importers keep the names)
    FLOAT32_BELOW,
    PromptTree,
    attend,
    attend_prompt_tree,
    causal_attention,
    window_mask,
)

VARLEN = "tether_varlen"
"""The ``attn_implementation`` name of the ``split`` kernel (sdpa per sequence or per equal-length bucket)."""
VARLEN_TORCH = "tether_varlen_torch"
"""The ``attn_implementation`` name of the ``torch`` kernel (``torch.nn.attention.varlen.varlen_attn``)."""

_HOST_LENGTHS: dict[int, tuple[weakref.ref, tuple[int, ...], PromptTree | None]] = {}
"""Lengths of the live ``cu_seqlens`` tensors, by their storage address (see :func:`host_lengths`), and the
shared-prompt layout of those :func:`prompt_tree_kwargs` built."""
_HOST_LENGTHS_KEPT = 64


def cu_seqlens_from_position_ids(position_ids: Tensor) -> Tensor:
    """Sequence boundaries of a packed row: ``[1, T]`` position ids -> int32 ``[S + 1]`` offsets.

    A sequence starts wherever the position id does not follow its predecessor by one (a restart at 0,
    or the first token), which is the rule transformers and flash-attn use for packed rows.
    """
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    idx = starts.nonzero().flatten()
    end = torch.tensor([pos.numel()], dtype=idx.dtype, device=idx.device)
    return torch.cat([idx, end]).to(torch.int32)


def cu_seqlens_kwargs(
    lengths: list[int], device: torch.device | None = None, *, prompt_tree: PromptTree | None = None
) -> dict:
    """The flash-attention kwargs of a packed row of sequences of ``lengths`` tokens.

    Passed to the model's forward they reach the attention function of every layer, so the boundaries
    are computed once per micro-batch; ``flash_attention_2`` reads the same keys. ``prompt_tree``: the
    row's shared-prompt layout, remembered beside the lengths (use :func:`prompt_tree_kwargs`).
    """
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    cu = cu.to(device) if device is not None else cu
    _remember(cu, tuple(int(n) for n in lengths), prompt_tree)
    longest = max(lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def prompt_tree_kwargs(tree: PromptTree, device: torch.device | None = None) -> dict:
    """The kwargs of a packed row laid out as shared prompts (``learner.share_prompts``).

    ``cu_seq_lens_*`` mark every prompt and completion as a segment, and the layout is remembered beside
    them, so this module's attention lets each completion see its prompt (:func:`attend_prompt_tree`).
    Only this module's kernels read it: flash_attention_2 would take the segments for whole sequences, so
    the learner shares prompts only on the ``tether_varlen`` kernels.
    """
    segments = [n for prompt, completions in tree for n in (prompt, *completions)]
    return cu_seqlens_kwargs(segments, device, prompt_tree=tree)


def host_prompt_tree(cu: Tensor | None) -> PromptTree | None:
    """The shared-prompt layout :func:`prompt_tree_kwargs` built ``cu`` for (None: plain sequences); as
    :func:`host_lengths`, valid while that tensor lives."""
    if cu is None or host_lengths(cu) is None:
        return None
    return _HOST_LENGTHS[cu.data_ptr()][2]


def _remember(cu: Tensor, lengths: tuple[int, ...], tree: PromptTree | None) -> None:
    _HOST_LENGTHS[cu.data_ptr()] = (weakref.ref(cu), lengths, tree)
    while len(_HOST_LENGTHS) > _HOST_LENGTHS_KEPT:
        del _HOST_LENGTHS[next(iter(_HOST_LENGTHS))]


def host_lengths(cu: Tensor) -> tuple[int, ...] | None:
    """The lengths :func:`cu_seqlens_kwargs` built ``cu`` from, or None for a tensor it did not build.

    Keyed by the storage address, and valid only while the tensor it was built for is alive: two live
    tensors never share an address, so ``cu`` is then that tensor or a view of it (torch.compile may hand
    the attention function another Python object for the same storage). A dead one's entry is ignored.
    """
    found = _HOST_LENGTHS.get(cu.data_ptr())
    if found is None or found[0]() is None or len(found[1]) != cu.shape[0] - 1:
        return None
    return found[1]


def varlen_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    lengths: list[int],
    *,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention within each segment of a packed row.

    query ``[1, H, T, D]``, key/value ``[1, H_kv, T, D]`` (``H % H_kv == 0``), ``sum(lengths) == T``;
    returns ``[1, H, T, D]``. Equal to running sdpa on every sequence alone and concatenating.
    ``window``, ``softcap`` and ``sinks`` (``[H]``) as :func:`attend` takes them, applied per sequence.

    Sequences of equal length run as one batch (see :func:`length_buckets`): a GRPO group's samples share
    their prompt, so full-length completions make whole groups one sdpa call each instead of one per sample.
    """
    if window is None and softcap is None and sinks is None:
        attend_one = functools.partial(causal_attention, scale=scale)
    else:
        attend_one = functools.partial(attend, scale=scale, window=window, softcap=softcap, sinks=sinks)
    if len(lengths) == 1:
        return attend_one(query, key, value)
    order, inverse, buckets = length_buckets(tuple(lengths), query.device)
    if order is None:  # every length distinct: one call per sequence, no gather
        parts = zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True)
        return torch.cat([attend_one(q, k, v) for q, k, v in parts], dim=2)
    sizes = [n * length for n, length in buckets]
    per_bucket = (x[0].index_select(1, order).split(sizes, dim=1) for x in (query, key, value))
    outs = []
    for (n, length), q, k, v in zip(buckets, *per_bucket, strict=True):
        # [H, n·L, D] -> [n, H, L, D]: the bucket's sequences become the batch
        q, k, v = (x.unflatten(1, (n, length)).transpose(0, 1) for x in (q, k, v))
        outs.append(attend_one(q, k, v).transpose(0, 1).flatten(1, 2))
    return torch.cat(outs, dim=1).index_select(1, inverse).unsqueeze(0)


@functools.lru_cache(maxsize=16)
def _bucket_plan(lengths: tuple[int, ...]) -> tuple[np.ndarray | None, np.ndarray | None, list[tuple[int, int]]]:
    by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    if len(by_length) == len(lengths):
        return None, None, []
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    order = np.concatenate([(starts[idx][:, None] + np.arange(n)).ravel() for n, idx in by_length.items()])
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return order, inverse, [(len(idx), n) for n, idx in by_length.items()]


def length_buckets(lengths: tuple[int, ...], device: torch.device) -> tuple[Tensor | None, Tensor | None, list]:
    """How a packed row's sequences group by length: ``(order, inverse, [(count, length), ...])``.

    ``order`` gathers the row's token positions bucket by bucket (each bucket's sequences back to back,
    so it reshapes to ``[count, length]``); ``inverse`` puts the results back. ``(None, None, [])`` when
    no two sequences share a length (nothing to batch). Every layer of a forward sees the same lengths,
    so the plan is computed once and cached.
    """
    order, inverse, buckets = _bucket_plan(lengths)
    if order is None:
        return None, None, []
    return torch.from_numpy(order).to(device), torch.from_numpy(inverse).to(device), buckets


def _lengths(query: Tensor, kwargs: dict) -> list[int]:
    cu = kwargs.get("cu_seq_lens_q")
    known = host_lengths(cu) if cu is not None else None
    if known is not None:
        lengths = list(known)
    else:  # boundaries the learner did not build: read from the device (one host sync)
        if cu is None and kwargs.get("position_ids") is not None:
            cu = cu_seqlens_from_position_ids(kwargs["position_ids"])
        if cu is None:
            return [query.shape[2]]
        lengths = [b - a for a, b in itertools.pairwise(cu.tolist())]
    if sum(lengths) != query.shape[2]:
        raise ValueError(f"cu_seq_lens_q covers {sum(lengths)} tokens but the packed row has {query.shape[2]}")
    return lengths


@torch.compiler.disable
def varlen_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    *,
    kernel: str = "split",
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers attention-function signature; returns ``([B, T, H, D], None)`` like sdpa's.

    ``sliding_window``, ``softcap`` and ``s_aux`` (attention sinks, in ``kwargs``) are the layer's, as
    transformers passes them (see :func:`attend`). ``kernel="torch"`` (:data:`VARLEN_TORCH`, bound by
    :func:`register`) runs packed rows in half precision through :func:`torch_varlen_sdpa` where that kernel
    can (:func:`torch_kernel_fits`); a float32 model (a test, a reference pass), softcap or sinks get the
    split kernel there too.
    """
    _refuse(module, attention_mask, dropout)
    sinks = kwargs.get("s_aux")
    extras = {"window": sliding_window, "softcap": softcap, "sinks": sinks}
    half = query.dtype in (torch.bfloat16, torch.float16) or torch.is_autocast_enabled(query.device.type)
    tree = host_prompt_tree(kwargs.get("cu_seq_lens_q")) if query.shape[0] == 1 else None
    if tree is not None:  # shared prompts: every kernel runs them split (torch's varlen has no such layout)
        out = attend_prompt_tree(query, key, value, tree, scale=scaling, **extras)
    elif query.shape[0] > 1:
        # Several rows (a dummy or right-padded batch): causal attention per row needs no mask because
        # right padding only ever follows the real tokens.
        out = attend(query, key, value, scale=scaling, **extras)
    elif kernel == "torch" and query.device.type == "cuda" and half and torch_kernel_fits(**extras):
        lengths = _lengths(query, kwargs)
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None:
            cu = cu_seqlens_kwargs(lengths, query.device)["cu_seq_lens_q"]
        out = torch_varlen_sdpa(
            query, key, value, cu.to(torch.int32), max(lengths), scale=scaling, window=sliding_window
        )
    else:
        out = varlen_sdpa(query, key, value, _lengths(query, kwargs), scale=scaling, **extras)
    return out.transpose(1, 2).contiguous(), None


def _refuse(module: torch.nn.Module, attention_mask: Tensor | None, dropout: float) -> None:
    if attention_mask is not None:
        raise ValueError(
            f"{VARLEN} attention got an attention mask; it serves packed rows (no mask, restarting position "
            "ids) — use attn_implementation sdpa for padded batches"
        )
    if dropout:
        raise NotImplementedError(f"{VARLEN} attention has no dropout; set the model's attention_dropout to 0")
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError(
            f"{VARLEN} attention is causal only and this model's attention is bidirectional "
            "(use_bidirectional_attention); set learner.use_remove_padding false for this model"
        )


def torch_kernel_fits(*, window: int | None, softcap: float | None, sinks: Tensor | None) -> bool:
    """Whether torch's varlen kernel computes this layer's attention: it has no softcap and no sinks, and
    takes a sliding window only through ``window_size`` (torch > 2.10). Where it cannot, the split kernel
    runs the layer instead (correct, slower)."""
    if softcap is not None or sinks is not None:
        return False
    return window is None or "window_size" in _torch_varlen_params()


def torch_varlen_available(device: torch.device) -> bool:
    """Whether ``torch.nn.attention.varlen.varlen_attn`` exists in this torch and can run on ``device``."""
    return device.type == "cuda" and _torch_varlen() is not None


@functools.cache
def _torch_varlen():  # type: ignore[no-untyped-def]
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.cache
def _torch_varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_torch_varlen()).parameters)


def torch_varlen_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu: Tensor,
    longest: int,
    *,
    scale: float | None,
    window: int | None = None,
) -> Tensor:
    """:func:`varlen_sdpa` through torch's flash varlen kernel: one launch for the whole packed row.

    The same shapes in and out (``[1, H, T, D]``); ``cu``: int32 ``[S + 1]`` boundaries on the query's device,
    ``longest`` the longest sequence. torch 2.10 spells causal ``is_causal=True`` and has no
    ``scale`` or ``enable_gqa``; later releases take ``window_size=(-1, 0)``, ``scale`` and ``enable_gqa``.
    Where the kernel lacks them, key/value heads are repeated and a non-default scale is folded into the query.

    ``window`` (transformers' ``sliding_window``: keys ``0 <= i - j < window``) is flash's
    ``window_size=(window - 1, 0)``, the mapping transformers' flash integration makes; a window no shorter
    than ``longest`` is plain causal. A torch without ``window_size`` cannot take one (see
    :func:`torch_kernel_fits`).
    """
    params = _torch_varlen_params()
    if window is not None and window >= longest:
        window = None
    if window is not None and "window_size" not in params:
        raise ValueError(
            f"torch {torch.__version__}'s varlen_attn has no window_size; run sliding-window layers on the "
            "split kernel (learner.varlen_attention: split)"
        )
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type):  # rotary made q/k float32; the flash kernel wants half
        dtype = torch.get_autocast_dtype(query.device.type)
    q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # [T, H, D]
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (window - 1 if window is not None else -1, 0)
    else:
        kwargs["is_causal"] = True
    if scale is not None:
        if "scale" in params:
            kwargs["scale"] = scale
        else:
            q = q * (scale * math.sqrt(q.shape[-1]))
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    out = _torch_varlen()(q, k, v, cu, cu, longest, longest, **kwargs)
    return out.transpose(0, 1).unsqueeze(0)


def register(kernel: str = "split") -> str:
    """Register the attention function of ``kernel`` (``split`` or ``torch``) with transformers
    (idempotent); returns its ``attn_implementation`` name."""
    from transformers import AttentionInterface

    if kernel == "torch":
        AttentionInterface.register(VARLEN_TORCH, functools.partial(varlen_attention_forward, kernel="torch"))
        return VARLEN_TORCH
    AttentionInterface.register(VARLEN, varlen_attention_forward)
    return VARLEN
