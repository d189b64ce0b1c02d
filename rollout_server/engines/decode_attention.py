"""Grouped-query attention for the decode step without copying the KV cache.

With grouped-query attention (fewer KV heads than query heads) and an attention mask, transformers'
``sdpa`` path calls ``repeat_kv`` on every layer of every step: it copies the whole cache of keys and
values ``num_key_value_groups`` times so each query head gets its own (sdpa's ``enable_gqa`` is used
only without a mask, and the engine's left-padded batch always has one). In a decode step that copy
is the largest single cost after the matmuls, and it grows with the cache.

A decode step has one query token per row, so the ``groups`` query heads that share a KV head can be
read as ``groups`` query *positions* of that KV head instead: ``[B, H, 1, D]`` becomes
``[B, H_kv, groups, D]`` (a view), the row's mask ``[B, 1, 1, L]`` broadcasts over them, and one sdpa
call attends to the cache as it is. Same arithmetic, no copy. Prefill (more than one query token, a
causal mask per token) goes to transformers' own ``sdpa`` unchanged.

Registered with transformers' ``AttentionInterface`` under :data:`DECODE_SDPA`, with sdpa's mask
builder, and used by the transformers engine when ``model.attn_implementation`` is ``sdpa`` **on the CPU
only**. On CUDA (an H200, torch 2.11) the engine keeps transformers' sdpa with cuDNN's kernel off, the
combination measured there (1.54x ``model.generate``); this regrouping was timed there only with cuDNN's
kernel on (33 ms a decode step of the 128x2 tiny model, as slow as plain sdpa was with it), so it is not
known to pay on a GPU, where the KV copy is cheap at HBM bandwidth anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

DECODE_SDPA = "tether_decode_sdpa"
"""The ``attn_implementation`` name this module registers."""


def decode_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``query`` [B, H, Q, D], ``key``/``value`` [B, H_kv, L, D] -> (output [B, Q, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    groups = heads // key.shape[1]
    if groups == 1 or q_len != 1 or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query.reshape(batch, key.shape[1], groups, dim),
        key,
        value,
        attn_mask=attention_mask,  # [B, 1, 1, L]: the same for every query head of the row
        dropout_p=dropout,
        scale=scaling,
    )
    return out.reshape(batch, 1, heads, dim), None


def register() -> str:
    """Make :data:`DECODE_SDPA` known to transformers (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(DECODE_SDPA, decode_sdpa_forward)
    AttentionMaskInterface.register(DECODE_SDPA, sdpa_mask)
    return DECODE_SDPA
