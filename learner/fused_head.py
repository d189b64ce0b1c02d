"""The LM head fused with log-probs and entropy, chunk by chunk: no ``[tokens, vocab]`` tensor outlives a chunk.

Without it the model returns the completion positions' logits (``[N, V]`` in the compute dtype: 10 GB at 32K
tokens of a 152K vocabulary in bf16), kept for backward, and :mod:`learner.logprobs` makes float32 copies of
them chunk by chunk for the log-softmax and again for the entropy. Here the head itself takes the hidden
states and, for each chunk of ``chunk_size`` rows, computes the chunk's logits, upcasts them once, and returns
the log-prob of the target and the entropy; in backward each chunk's logits are recomputed
(``torch.utils.checkpoint``) instead of stored. Cost: the LM head's forward once more in backward (at the
Qwen2.5-0.5B shape the head is ~27 % of the forward's matmul FLOPs); saving: every ``[N, V]`` float32 pass but
one per chunk, and the stored logits. The idea is prime-rl's chunked LM head and verl's ``use_fused_kernels``
(there a Triton kernel; here plain torch, so it runs on CPU too and under FSDP2, autocast and compile alike).

:func:`install` swaps the model's output embedding for a :class:`FusedHead` holding the same weight (tied
weights stay tied, the parameter keeps its name, so checkpoints and weight sync see no change). The head acts
as the plain linear layer except inside :meth:`FusedHead.scoring`, where its output is ``[..., 2]``: the
log-prob and the entropy of each row.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@dataclass
class _Request:
    targets: Tensor  # [N] int64
    temperature: Tensor | None  # [N] or None
    with_entropy: bool
    entropy_grad: bool
    chunk_size: int


class FusedHead(nn.Module):
    """Stands in for the model's ``nn.Linear`` LM head; same ``weight`` (and ``bias``) parameters."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = head.weight
        self.bias = head.bias
        self._request: _Request | None = None

    @contextlib.contextmanager
    def scoring(
        self, targets: Tensor, *, temperature: Tensor | None, with_entropy: bool, entropy_grad: bool, chunk_size: int
    ) -> Iterator[None]:
        """Within: a forward over ``N`` kept positions returns ``[1, N, 2]`` (log-prob of ``targets``, entropy)."""
        self._request = _Request(targets, temperature, with_entropy, entropy_grad, chunk_size)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: Tensor) -> Tensor:
        req = self._request
        if req is None:
            return F.linear(hidden, self.weight, self.bias)
        rows = hidden.reshape(-1, hidden.shape[-1])
        if rows.shape[0] != req.targets.shape[0]:
            raise ValueError(f"fused LM head: {rows.shape[0]} positions but {req.targets.shape[0]} targets")
        parts = []
        for start in range(0, rows.shape[0], req.chunk_size):
            s = slice(start, start + req.chunk_size)
            temp = req.temperature[s] if req.temperature is not None else None
            args = (rows[s], self.weight, self.bias, req.targets[s], temp, req.with_entropy, req.entropy_grad)
            if torch.is_grad_enabled() and rows.requires_grad:
                parts.append(checkpoint(_score_chunk, *args, use_reentrant=False))
            else:
                parts.append(_score_chunk(*args))
        return torch.cat(parts).reshape(*hidden.shape[:-1], 2)


def _score_chunk(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: Tensor | None,
    with_entropy: bool, entropy_grad: bool,
) -> Tensor:  # fmt: skip
    """``[c, d]`` hidden states -> ``[c, 2]`` float32 (log-prob of the target, entropy or 0)."""
    logits = F.linear(hidden, weight, bias).float()
    if temperature is not None:
        logits = logits / temperature.to(logits.dtype)[:, None]
    lse = torch.logsumexp(logits, dim=-1)
    logprob = logits.gather(-1, targets[:, None]).squeeze(-1) - lse
    if with_entropy:
        src, src_lse = (logits, lse) if entropy_grad else (logits.detach(), lse.detach())
        entropy = src_lse - (torch.softmax(src, dim=-1) * src).sum(-1)
    else:
        entropy = torch.zeros_like(logprob)
    return torch.stack([logprob, entropy], dim=-1)


def install(model: nn.Module) -> FusedHead | None:
    """Swap ``model``'s output embedding for a :class:`FusedHead` (in place); returns it, or None where the
    model has no plain linear LM head (a value model, a head of another kind)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    if isinstance(head, FusedHead):
        return head
    if not isinstance(head, nn.Linear):
        return None
    for module in model.modules():
        for child_name, child in module.named_children():
            if child is head:
                fused = FusedHead(head)
                setattr(module, child_name, fused)
                # Found again by :func:`find` without a walk; kept out of ``_modules`` (no second state-dict key).
                model.__dict__["_tether_fused_head"] = fused
                return fused
    raise RuntimeError(f"fused LM head: {type(head).__name__} is not a child of any module of the model")


def find(model: nn.Module) -> FusedHead | None:
    """The :class:`FusedHead` :func:`install` put in ``model``, if any."""
    return getattr(model, "_tether_fused_head", None)
