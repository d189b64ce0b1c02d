"""Token log-probs and entropies from a causal LM over one micro-batch, with a bounded vocab peak.

The LM head runs only on the positions that predict completion tokens (``logits_to_keep`` with an
index tensor), so logits are ``[N_completion, vocab]``. Log-softmax and entropy then go over those rows
in chunks: the full softmax of a long batch would otherwise hold a second and third ``[N, vocab]``
float32 tensor at once. With ``checkpoint=True`` each chunk's entropy is recomputed in backward instead
of keeping its softmax alive (``entropy_checkpointing``). With ``temperature`` the logits are divided
by each token's sampling temperature first (verl's actor convention), so log-probs and entropy are of
the distribution the rollout sampled from, the one its behaviour log-probs are of.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as _checkpoint

from learner import fused_head, ulysses
from learner.packing import MicroBatch
from learner.varlen_attention import cu_seqlens_kwargs, prompt_tree_kwargs

DEFAULT_CHUNK = 2048


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) per row: [N, V] -> [N] (float32)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    return lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def entropy_from_logits_with_chunking(
    logits: Tensor, *, chunk_size: int = DEFAULT_CHUNK, checkpoint: bool = False
) -> Tensor:
    """Same as :func:`entropy_from_logits`, ``chunk_size`` rows at a time."""
    parts = []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start : start + chunk_size]
        if checkpoint and chunk.requires_grad:
            parts.append(_checkpoint(entropy_from_logits, chunk, use_reentrant=False))
        else:
            parts.append(entropy_from_logits(chunk))
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def logprobs_from_logits(logits: Tensor, targets: Tensor, *, chunk_size: int = DEFAULT_CHUNK) -> Tensor:
    """log softmax(logits)[target] per row in float32: [N, V], [N] -> [N]."""
    parts = []
    for start in range(0, logits.shape[0], chunk_size):
        chunk = logits[start : start + chunk_size].float()
        tgt = targets[start : start + chunk_size]
        parts.append(chunk.gather(-1, tgt[:, None]).squeeze(-1) - torch.logsumexp(chunk, dim=-1))
    return torch.cat(parts) if parts else logits.new_zeros(0, dtype=torch.float32)


def forward_micro_batch(
    model: torch.nn.Module,
    mb: MicroBatch,
    *,
    device: torch.device,
    with_entropy: bool = False,
    chunked_entropy: bool = True,
    entropy_checkpointing: bool = False,
    entropy_grad: bool = True,
    chunk_size: int = DEFAULT_CHUNK,
    temperature: Tensor | None = None,
    sp: ulysses.Layout | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run the model on one micro-batch; returns ``(logprobs [N], entropy [N] | None)`` in float32.

    ``temperature``: [N] per completion token (None: 1). An empty micro-batch must go through
    :func:`dummy_loss` instead. ``sp`` (SP > 1, packed rows only): this rank runs its sequence shard and
    the result is the whole micro-batch's, gathered over the SP group.
    """
    if mb.empty:
        raise ValueError("forward_micro_batch got an empty micro-batch; use dummy_loss")
    if sp is not None and sp.sp > 1:
        return _forward_sequence_parallel(
            model, mb, sp, device=device, with_entropy=with_entropy, chunked_entropy=chunked_entropy,
            entropy_checkpointing=entropy_checkpointing, entropy_grad=entropy_grad, chunk_size=chunk_size,
            temperature=temperature,
        )  # fmt: skip
    input_ids = mb.input_ids.to(device, non_blocking=True)
    position_ids = mb.position_ids.to(device, non_blocking=True)
    index = mb.logit_index.to(device, non_blocking=True)
    kwargs = {"use_cache": False}
    if mb.attention_mask is not None:
        kwargs["attention_mask"] = mb.attention_mask.to(device, non_blocking=True)
        # The LM head only from the first column any row needs a logit at: the prompt columns every row
        # shares would otherwise cost a [rows, columns, vocab] product that is thrown away.
        seq = mb.input_ids.shape[1]
        first = int((mb.logit_index % seq).min())
        keep = seq - first
        logits = model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=keep, **kwargs).logits
        index = (index // seq) * keep + (index % seq - first)
        logits = logits.reshape(-1, logits.shape[-1])[index]
    else:
        # No attention mask + restarting position ids: transformers' packed-sequence path. The boundaries go
        # in once here so no layer re-derives them (flash_attention_2 and the varlen kernel both read them).
        if mb.prompt_tree is not None:
            kwargs.update(prompt_tree_kwargs(mb.prompt_tree, device))
        else:
            kwargs.update(cu_seqlens_kwargs(mb.seq_lengths, device))
        head = fused_head.find(model)
        if head is not None:  # learner.use_fused_kernels: the head returns (log-prob, entropy) per position
            with head.scoring(mb.targets.to(device, non_blocking=True),
                              temperature=temperature.to(device) if temperature is not None else None,
                              with_entropy=with_entropy, entropy_grad=entropy_grad, chunk_size=chunk_size):  # fmt: skip
                out = model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=index, **kwargs).logits[0]
            return out[:, 0], out[:, 1] if with_entropy else None
        logits = model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=index, **kwargs).logits[0]
    return _score(logits, mb.targets, device=device, with_entropy=with_entropy, chunked_entropy=chunked_entropy,
                  entropy_checkpointing=entropy_checkpointing, entropy_grad=entropy_grad, chunk_size=chunk_size,
                  temperature=temperature)  # fmt: skip


def _forward_sequence_parallel(
    model: torch.nn.Module, mb: MicroBatch, sp: ulysses.Layout, *, device: torch.device, temperature: Tensor | None,
    **score,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    if not mb.packed:
        raise ValueError("ulysses_sequence_parallel_size > 1 needs packed rows (learner.use_remove_padding: true)")
    if mb.prompt_tree is not None:
        raise ValueError("sequence parallelism runs one copy of the prompt per sample: build the micro-batch "
                         "without share_prompts")  # fmt: skip
    pad_id = int(getattr(model.config, "pad_token_id", None) or 0)
    shard = ulysses.shard_row(mb.input_ids, mb.logit_index, mb.seq_lengths, sp, pad_id=pad_id)
    kwargs = {"use_cache": False, **cu_seqlens_kwargs(shard.lengths, device)}
    logits = model(
        input_ids=shard.input_ids.to(device),
        position_ids=shard.position_ids.to(device),
        logits_to_keep=shard.logit_index.to(device),
        **kwargs,
    ).logits[0]
    temp = temperature[shard.local] if temperature is not None else None
    logprobs, entropy = _score(logits, mb.targets[shard.local], device=device, temperature=temp, **score)
    logprobs = ulysses.gather_rows(logprobs, shard, sp)
    return logprobs, ulysses.gather_rows(entropy, shard, sp) if entropy is not None else None


def _score(
    logits: Tensor, targets: Tensor, *, device: torch.device, with_entropy: bool, chunked_entropy: bool,
    entropy_checkpointing: bool, entropy_grad: bool, chunk_size: int, temperature: Tensor | None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """Log-probs of ``targets`` and (optionally) entropies from ``[N, vocab]`` logits, in float32."""
    if temperature is not None:
        logits = logits / temperature.to(device=device, dtype=logits.dtype)[:, None]
    targets = targets.to(device, non_blocking=True)
    logprobs = logprobs_from_logits(logits, targets, chunk_size=chunk_size)
    entropy = None
    if with_entropy and not entropy_grad:
        # Entropy only as a metric: no graph, no saved softmax.
        with torch.no_grad():
            entropy = entropy_from_logits_with_chunking(logits.detach(), chunk_size=chunk_size)
    elif with_entropy:
        if chunked_entropy:
            entropy = entropy_from_logits_with_chunking(logits, chunk_size=chunk_size, checkpoint=entropy_checkpointing)
        else:
            entropy = entropy_from_logits(logits)
    return logprobs, entropy


def dummy_loss(model: torch.nn.Module, mb: MicroBatch, *, device: torch.device) -> Tensor:
    """A zero connected to every parameter: the backward of a rank with less work than the others must
    still run the same FSDP collectives, or the ranks deadlock."""
    out = model(input_ids=mb.input_ids.to(device), position_ids=mb.position_ids.to(device), use_cache=False)
    return out.logits.float().sum() * 0.0
