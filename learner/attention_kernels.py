"""Causal attention over one batch of equal-length sequences, with the per-layer variants transformers hands
an attention function: sliding windows, logit soft-capping, attention sinks — and queries that are only the
last rows of their sequence (a completion attending to a prompt it shares with its group's other samples,
:func:`attend_prompt_tree`).

Shapes are transformers' ``[B, H, L, D]``; GQA runs without a ``repeat_kv`` copy. Queries may be fewer than
keys (``L_q <= L_k``): query row ``i`` then sits at position ``L_k - L_q + i`` of its sequence (the
bottom-right alignment of flash-attn's causal mask), so with ``L_q == L_k`` everything is plain causal
attention. :mod:`learner.varlen_attention` cuts packed rows into these calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

PromptTree = tuple[tuple[int, tuple[int, ...]], ...]
"""A packed row laid out as shared prompts: ``((prompt_len, (completion_len, ...)), ...)`` in row order, each
prompt's tokens once, then each of its completions; a completion sees its prompt and itself, causally.
A plain sequence is a prompt with no completions."""

FLOAT32_BELOW = 256
"""On CPU, half-precision sequences shorter than this attend in float32 (see :func:`causal_attention`)."""


def causal_attention(query: Tensor, key: Tensor, value: Tensor, *, scale: float | None) -> Tensor:
    """Causal sdpa over ``[B, H, L, D]`` (GQA through ``enable_gqa``), in float32 where that is faster.

    On CPU the bf16 flash-attention kernel's backward costs far more than its float32 one for short
    sequences (measured on one AVX512-BF16 core, forward + backward: 7× at 2 heads × 20 tokens × 32 dims,
    4× at 8 heads × 80 tokens, 1.7× at 128 tokens × 64 dims, level at 256, 0.7–0.9× from 512 on), so
    below :data:`FLOAT32_BELOW` tokens half-precision inputs attend in float32 and the output is cast
    back: more precise, and the whole bf16 step at 256 wide ran ~1.6× faster. GPUs keep their dtype.
    """
    gqa = query.shape[1] != key.shape[1]
    if query.device.type == "cpu" and query.shape[-2] < FLOAT32_BELOW and _half_precision(query):
        q, k, v = (x.float() for x in (query, key, value))
        with torch.autocast("cpu", enabled=False):  # autocast would cast them straight back to bf16
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.to(query.dtype)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)


def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention over ``[B, H, L, D]`` with transformers' per-layer variants; ``[B, H, L_q, D]`` out.

    ``window``: the query at ``i`` sees keys ``j`` with ``0 <= i - j < window`` (transformers'
    ``sliding_window``). ``softcap``: scores ``s`` become ``tanh(s / softcap) · softcap`` before the mask
    (Gemma 2). ``sinks``: ``[H]`` logits, one per query head, added to every softmax denominator
    (gpt-oss's ``s_aux``). With none of them (or a window no shorter than ``L``) this is
    :func:`causal_attention`; a window alone is sdpa with a boolean mask; softcap or sinks are computed
    explicitly. The float32-below-:data:`FLOAT32_BELOW` rule of :func:`causal_attention` holds throughout.
    Queries fewer than keys are the sequence's last ``L_q`` positions (a boolean mask, bottom-right).
    """
    if window is not None and window >= key.shape[-2]:
        window = None  # the window reaches the first token from every query: plain causal
    square = query.shape[-2] == key.shape[-2]
    if window is None and softcap is None and sinks is None and square:
        return causal_attention(query, key, value, scale=scale)
    if sinks is not None and sinks.numel() != query.shape[1]:
        raise ValueError(
            f"tether_varlen attention got {sinks.numel()} attention sinks for {query.shape[1]} query heads; "
            "a wrapper that splits heads (sequence parallelism) must pass each rank its heads' sinks"
        )
    fn = _explicit_attention if softcap is not None or sinks is not None else _windowed_sdpa
    if _float32_on_cpu(query, key):
        q, k, v = (x.float() for x in (query, key, value))
        with torch.autocast("cpu", enabled=False):
            out = fn(q, k, v, scale=scale, window=window, softcap=softcap, sinks=_float(sinks))
        return out.to(query.dtype)
    return fn(query, key, value, scale=scale, window=window, softcap=softcap, sinks=sinks)


def window_mask(length: int, window: int | None, device: torch.device, *, keys: int | None = None) -> Tensor:
    """``[L, keys]`` bool (``keys`` defaults to ``L``), True where the query (row) may see the key (column):
    causal, and within ``window`` tokens (the query itself included) when one is given. With more keys than
    queries the queries are the last ``L`` positions."""
    keys = length if keys is None else keys
    key_pos = torch.arange(keys, device=device)
    behind = (key_pos[keys - length :, None]) - key_pos[None, :]
    allowed = behind >= 0
    return allowed & (behind < window) if window is not None else allowed


def _windowed_sdpa(
    query: Tensor, key: Tensor, value: Tensor, *, scale: float | None, window: int | None, **_: object
) -> Tensor:
    mask = window_mask(query.shape[-2], window, query.device, keys=key.shape[-2])
    gqa = query.shape[1] != key.shape[1]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)


def _explicit_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    scale: float | None,
    window: int | None,
    softcap: float | None,
    sinks: Tensor | None,
) -> Tensor:
    """Eager attention with softcap and sinks, as transformers' Gemma 2 and gpt-oss eager functions do it.

    GQA without ``repeat_kv``: query heads ``[H_kv · G]`` (transformers' order: query head ``h`` reads kv
    head ``h // G``) become ``[H_kv, G]`` and the keys broadcast over ``G``. The softmax runs in float32.
    """
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[-2]
    scale = dim**-0.5 if scale is None else scale
    q = query.unflatten(1, (kv_heads, heads // kv_heads))  # [B, H_kv, G, L, D]
    scores = q @ key.unsqueeze(2).transpose(-1, -2) * scale  # [B, H_kv, G, L, keys]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~window_mask(length, window, query.device, keys=keys), float("-inf")).float()
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().reshape(1, kv_heads, -1, 1, 1).expand(batch, -1, -1, length, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # the sink adds no value
    return (probs.to(value.dtype) @ value.unsqueeze(2)).flatten(1, 2)


def _float32_on_cpu(query: Tensor, key: Tensor) -> bool:
    return query.device.type == "cpu" and key.shape[-2] < FLOAT32_BELOW and _half_precision(query)


def _float(x: Tensor | None) -> Tensor | None:
    return x.float() if x is not None else None


def _half_precision(query: Tensor) -> bool:
    """Whether sdpa would run in half precision: half inputs (FSDP2 mixed precision), or CPU autocast to a
    half dtype (an unsharded learner; rotary embeddings have made ``query`` float32 by then)."""
    half = (torch.bfloat16, torch.float16)
    return query.dtype in half or (torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in half)


def attend_prompt_tree(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    tree: PromptTree,
    *,
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention over a packed row laid out as shared prompts (:data:`PromptTree`); ``[1, H, T, D]`` in and out.

    A prompt attends to itself causally; each completion's queries attend to its prompt's keys followed by
    its own (the completion's rows of the sequence prompt + completion), so every completion gets exactly the
    attention it would get alone behind its own copy of the prompt, while the prompt's tokens run through the
    model once. A prompt's completions of one length run as one batch, the prompt's keys broadcast to it.
    """
    extras = {"scale": scale, "window": window, "softcap": softcap, "sinks": sinks}
    sizes = [n for prompt, completions in tree for n in (prompt, *completions)]
    if sum(sizes) != query.shape[2]:
        raise ValueError(f"the prompt tree covers {sum(sizes)} tokens but the packed row has {query.shape[2]}")
    qs, ks, vs = (x.split(sizes, dim=2) for x in (query, key, value))
    outs: list[Tensor | None] = [None] * len(sizes)
    at = 0
    for _prompt, completions in tree:
        kp, vp = ks[at], vs[at]
        outs[at] = attend(qs[at], kp, vp, **extras)
        by_length: dict[int, list[int]] = {}
        for j, n in enumerate(completions, start=at + 1):
            by_length.setdefault(n, []).append(j)
        for members in by_length.values():
            q = torch.cat([qs[j] for j in members])  # [n, H, c, D]
            k, v = (
                torch.cat([p.expand(len(members), -1, -1, -1), torch.cat([x[j] for j in members])], dim=2)
                for p, x in ((kp, ks), (vp, vs))
            )
            for j, out in zip(members, attend(q, k, v, **extras).split(1), strict=True):
                outs[j] = out
        at += 1 + len(completions)
    return torch.cat(outs, dim=2)  # type: ignore[arg-type]
