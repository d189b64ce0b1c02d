"""Varlen attention equals per-sequence sdpa (values and gradients, GQA included) and builds no (ΣL)² mask."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from learner.parallelize import attn_implementation
from learner.varlen_attention import (
    VARLEN,
    cu_seqlens_from_position_ids,
    cu_seqlens_kwargs,
    varlen_sdpa,
)
from tests.helpers import tiny_qwen2
from tether.config import TetherConfig


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each sequence alone through plain causal softmax attention in float64 (kv heads repeated)."""
    rep = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[:, :, start : start + n].double() for x in (q, k, v))
        ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
        scores = qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
        outs.append(torch.softmax(scores, -1) @ vs)
        start += n
    return torch.cat(outs, dim=2).to(q.dtype)


DISTINCT = [1, 17, 5, 64, 3, 30]
SHARED = [9, 17, 9, 9, 1, 17, 30, 9, 1]  # buckets of 4, 2, 2 and 1 sequences, interleaved


@pytest.mark.parametrize("lengths", [DISTINCT, SHARED], ids=["distinct", "shared"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (6, 1)])
def test_varlen_sdpa_equals_each_sequence_alone(heads: int, kv_heads: int, lengths: list[int]) -> None:
    g = torch.Generator().manual_seed(heads * 10 + kv_heads + len(lengths))
    total, dim = sum(lengths), 16
    q = torch.randn(1, heads, total, dim, generator=g, requires_grad=True)
    k = torch.randn(1, kv_heads, total, dim, generator=g, requires_grad=True)
    v = torch.randn(1, kv_heads, total, dim, generator=g, requires_grad=True)
    out = varlen_sdpa(q, k, v, lengths, scale=None)
    want = _reference(q, k, v, lengths)
    assert_close(out, want, atol=1e-5, rtol=1e-5)
    upstream = torch.randn(out.shape, generator=g)
    got_grads = torch.autograd.grad(out, (q, k, v), upstream)
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)
    for got, exp in zip(got_grads, want_grads, strict=True):
        assert_close(got, exp, atol=1e-5, rtol=1e-5)


def test_sequences_of_one_length_share_one_sdpa_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """One call per distinct length (4 here, not 9), each with that length's sequences as its batch;
    distinct lengths keep one call per sequence."""
    from learner import varlen_attention

    calls: list[tuple[int, ...]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(tuple(q.shape))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(varlen_attention.F, "scaled_dot_product_attention", counted)
    for lengths in (SHARED, DISTINCT):
        calls.clear()
        q = torch.randn(1, 2, sum(lengths), 8)
        varlen_sdpa(q, q, q, lengths, scale=None)
        counts = {n: lengths.count(n) for n in lengths}
        assert sorted(calls) == sorted((counts[n], 2, n, 8) for n in (counts if lengths is SHARED else lengths))


def _sdpa_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype sdpa really computes in, call by call (after autocast's own cast, as the kernel sees it)."""
    from learner import varlen_attention

    seen: list[torch.dtype] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        cast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu")
        seen.append(cast if cast else q.dtype)
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(varlen_attention.F, "scaled_dot_product_attention", recorded)
    return seen


def test_short_half_precision_sequences_attend_in_float32_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 inputs (FSDP2 mixed precision) and float32 inputs under bf16 autocast (an unsharded learner)
    both attend in float32 below FLOAT32_BELOW tokens and give the float32 numbers; from there on bf16 stays."""
    from learner.varlen_attention import FLOAT32_BELOW

    seen = _sdpa_dtypes(monkeypatch)
    g = torch.Generator().manual_seed(7)
    lengths = [20, 20, 9]
    q, k, v = (torch.randn(1, 2, sum(lengths), 16, generator=g) for _ in range(3))
    want = _reference(q, k, v, lengths)
    half = varlen_sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), lengths, scale=None)
    assert half.dtype == torch.bfloat16 and seen == [torch.float32] * 2
    assert_close(half.float(), want, atol=2e-2, rtol=2e-2)  # the inputs' own bf16 rounding only
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = varlen_sdpa(q, k, v, lengths, scale=None)
        assert seen == [torch.float32] * 2
        seen.clear()
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert seen == [torch.bfloat16]  # plain sdpa under this autocast runs in bf16
    seen.clear()
    assert_close(auto.float(), want, atol=1e-5, rtol=1e-5)
    long = torch.randn(1, 2, FLOAT32_BELOW, 16, generator=g, dtype=torch.bfloat16)
    varlen_sdpa(long, long, long, [FLOAT32_BELOW], scale=None)
    assert seen == [torch.bfloat16]


def test_boundaries_from_position_ids_match_the_lengths() -> None:
    lengths = [3, 1, 4, 2]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = cu_seqlens_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 4, 8, 10]
    assert cu.tolist() == cu_seqlens_kwargs(lengths)["cu_seq_lens_q"].tolist()
    assert cu_seqlens_kwargs(lengths)["max_length_q"] == 4


def _model(attn: str) -> torch.nn.Module:
    return tiny_qwen2(attn, max_position=1024)


@pytest.mark.parametrize("lengths", [[7, 20, 2, 13], [7, 20, 7, 7, 13, 20]], ids=["distinct", "shared"])
def test_packed_gradients_equal_the_sum_over_sequences_alone(lengths: list[int]) -> None:
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    packed, alone = _model(VARLEN), _model("sdpa")
    out = packed(input_ids=ids, position_ids=pos, use_cache=False, **cu_seqlens_kwargs(lengths))
    out.logits.float().logsumexp(-1).sum().backward()
    for seq in ids[0].split(lengths):
        alone(input_ids=seq[None]).logits.float().logsumexp(-1).sum().backward()
    for (name, p), q in zip(packed.named_parameters(), alone.parameters(), strict=True):
        assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("attn", [VARLEN, "sdpa"])
def test_no_row_squared_mask_is_built(attn: str) -> None:
    """Forward and backward of a packed row of 600 tokens: nothing of 600² elements exists with varlen
    (its largest tensor is the 64-vocab logits or a weight), while sdpa's block-diagonal mask has it —
    which shows the check can fail."""
    lengths = [150, 200, 100, 150]
    total = sum(lengths)
    model = _model(attn)
    ids = torch.randint(0, 64, (1, total), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    extra = cu_seqlens_kwargs(lengths) if attn == VARLEN else {}
    with _LargestTensor() as probe:
        model(input_ids=ids, position_ids=pos, use_cache=False, **extra).logits.sum().backward()
    assert (probe.largest < total * total) == (attn == VARLEN), probe.largest


@pytest.mark.parametrize(
    ("attn", "packed", "want"), [("sdpa", True, VARLEN), ("eager", True, VARLEN), ("sdpa", False, "sdpa")]
)
def test_learner_uses_varlen_for_packed_rows(attn: str, packed: bool, want: str) -> None:
    cfg = TetherConfig.model_validate(
        {"model": {"path": "unused", "attn_implementation": attn}, "learner": {"use_remove_padding": packed}}
    )
    assert attn_implementation(cfg, torch.device("cpu")) == want
