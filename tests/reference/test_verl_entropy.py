"""tether's per-token entropy and log-probs from logits (``learner/logprobs.py``) against verl 0.9.1's own.

- ``entropy_from_logits`` and ``entropy_from_logits_with_chunking`` (chunks smaller than the batch, with and
  without recompute in backward) vs ``verl.utils.torch_functional.entropy_from_logits`` and its chunked
  twin: values and gradients w.r.t. the logits, float32 logits; bf16 logits against verl's chunked version,
  which like tether's upcasts each chunk to float32.
- ``logprobs_from_logits`` (chunked) vs ``verl.utils.torch_functional.logprobs_from_logits`` (on CPU its
  ``logprobs_from_logits_v2`` path; flash-attn's cross-entropy kernel is not installed): values and
  gradients, float32 logits.
- the entropy term as the loss sees it: tether's entropies aggregated by ``aggregate`` vs
  ``core_algos.compute_entropy_loss`` (``agg_loss`` of verl's token entropies; its seq-mean-token-sum-norm
  length is the padded width), every ``LOSS_AGG_MODES`` mode.

No reference: log-probs of bf16 logits (verl takes bf16's log_softmax in bf16, tether upcasts first);
float64 logits (tether computes both in float32 by design). The log-probs of a real model forward
(``forward_micro_batch``, packed and padded rows) are compared with TRL's in ``test_trl_grpo.py``.
"""

from __future__ import annotations

import types

import pytest
import torch

from learner.logprobs import entropy_from_logits, entropy_from_logits_with_chunking, logprobs_from_logits
from learner.losses import LOSS_AGG_MODES, aggregate
from tests.reference.inputs import check, make_batch, pack, seq_ids

VOCAB = 300
ROWS = 61  # not a multiple of the chunk sizes below


def _logits(seed: int, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Wide logits: some rows nearly one-hot (entropy ~0), some flat (entropy ~log V).
    scale = torch.rand(*shape[:-1], 1, generator=gen) * 8.0
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize(
    "tether_fn",
    [
        pytest.param(entropy_from_logits, id="whole"),
        pytest.param(lambda x: entropy_from_logits_with_chunking(x, chunk_size=16), id="chunked"),
        pytest.param(lambda x: entropy_from_logits_with_chunking(x, chunk_size=16, checkpoint=True), id="checkpointed"),
    ],
)
def test_entropy_matches_verl(verl: types.SimpleNamespace, tether_fn) -> None:
    logits = _logits(0, torch.float32, ROWS, VOCAB).requires_grad_(True)
    reference = f"verl {verl.version} entropy_from_logits"
    want = verl.F.entropy_from_logits(logits)
    got = tether_fn(logits)
    check(got, want, what="entropy", reference=reference, dtype=torch.float32)
    weights = torch.randn(ROWS, generator=torch.Generator().manual_seed(1))
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    check(got_grad, want_grad, what="entropy d/dlogits", reference=reference, dtype=torch.float32)
    chunked = verl.F.entropy_from_logits_with_chunking(logits.detach(), chunk_size=16)
    check(
        got,
        chunked,
        what="entropy",
        reference=f"verl {verl.version} entropy_from_logits_with_chunking",
        dtype=torch.float32,
    )


def test_entropy_of_bf16_logits_matches_verl_chunked(verl: types.SimpleNamespace) -> None:
    logits = _logits(2, torch.bfloat16, ROWS, VOCAB)
    want = verl.F.entropy_from_logits_with_chunking(logits, chunk_size=16)
    reference = f"verl {verl.version} entropy_from_logits_with_chunking (bf16 logits)"
    for got in (entropy_from_logits(logits), entropy_from_logits_with_chunking(logits, chunk_size=16)):
        check(got, want, what="entropy", reference=reference, dtype=torch.float32)


@pytest.mark.parametrize("chunk_size", [16, 2048])
def test_logprobs_match_verl(verl: types.SimpleNamespace, chunk_size: int) -> None:
    logits = _logits(3, torch.float32, ROWS, VOCAB).requires_grad_(True)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(4))
    reference = f"verl {verl.version} logprobs_from_logits"
    want = verl.F.logprobs_from_logits(logits, targets)
    got = logprobs_from_logits(logits, targets, chunk_size=chunk_size)
    check(got, want, what="log-probs", reference=reference, dtype=torch.float32)
    weights = torch.randn(ROWS, generator=torch.Generator().manual_seed(5))
    (want_grad,) = torch.autograd.grad((want * weights).sum(), logits)
    (got_grad,) = torch.autograd.grad((got * weights).sum(), logits)
    check(got_grad, want_grad, what="log-probs d/dlogits", reference=reference, dtype=torch.float32)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_entropy_loss_matches_verl(verl: types.SimpleNamespace, mode: str) -> None:
    batch = make_batch(6, dtype=torch.float32)
    s, t = batch.mask.shape
    logits = _logits(7, torch.float32, s, t, VOCAB).requires_grad_(True)
    want = verl.core_algos.compute_entropy_loss(logits, response_mask=batch.mask, loss_agg_mode=mode)
    flat = pack(logits, batch.lengths)
    got = aggregate(
        entropy_from_logits_with_chunking(flat, chunk_size=32),
        pack(batch.mask, batch.lengths),
        seq_ids(batch.lengths),
        mode=mode,
        global_tokens=batch.tokens,
        global_seqs=batch.trained_seqs,
        norm_len=float(t),
    )
    reference = f"verl {verl.version} compute_entropy_loss"
    check(got, want, what=f"entropy loss {mode}", reference=reference, dtype=torch.float32)
    (want_grad,) = torch.autograd.grad(want, logits)
    (got_grad,) = torch.autograd.grad(got, logits)
    check(got_grad, want_grad, what=f"entropy loss {mode} d/dlogits", reference=reference, dtype=torch.float32)
