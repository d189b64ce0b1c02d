"""Varlen attention equals per-sequence sdpa (values and gradients, GQA included) and builds no (ΣL)² mask;
with a sliding window, Gemma 2's softcap or gpt-oss's sinks it equals transformers' own eager attention of
those models on each sequence alone, and torch's varlen kernel gets the window the way flash-attn reads it."""

from __future__ import annotations

import inspect
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from learner import varlen_attention as va
from learner.parallelize import attn_implementation
from learner.varlen_attention import (
    VARLEN,
    cu_seqlens_from_position_ids,
    cu_seqlens_kwargs,
    varlen_attention_forward,
    varlen_sdpa,
    window_mask,
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


# --- sliding windows, softcap, attention sinks ---------------------------------------------------------


def _hf_mask(n: int, window: int | None) -> torch.Tensor:
    """transformers' own mask functions on an ``[n, n]`` grid (True: the query of the row sees the key)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    fn = sliding_window_causal_mask_function(window) if window is not None else causal_mask_function
    pos = torch.arange(n)
    return fn(0, 0, pos[:, None], pos[None, :]).expand(n, n)


@pytest.mark.parametrize("window", [None, 1, 3, 8, 40])
def test_window_mask_is_transformers_sliding_window_convention(window: int | None) -> None:
    """``0 <= i - j < W``: the query sees itself and the W - 1 keys before it (flash's ``(W - 1, 0)``)."""
    assert torch.equal(window_mask(20, window, torch.device("cpu")), _hf_mask(20, window))


def _hf_eager(q, k, v, lengths, *, window, softcap, sinks):  # type: ignore[no-untyped-def]
    """Each sequence alone through transformers' eager attention of the model that has the feature, in
    float64: Gemma 2's (softcap) or gpt-oss's (sinks), with transformers' sliding-window mask."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    module = torch.nn.Module().eval()
    module.num_key_value_groups = q.shape[1] // k.shape[1]
    if sinks is not None:
        module.sinks = sinks.double()
    scaling = q.shape[-1] ** -0.5
    outs = []
    for qs, ks, vs in zip(*(x.double().split(lengths, dim=2) for x in (q, k, v)), strict=True):
        n = qs.shape[2]
        mask = torch.zeros(n, n, dtype=torch.float64).masked_fill(~_hf_mask(n, window), torch.finfo(torch.float64).min)
        if sinks is not None:
            out, _ = gpt_oss_eager(module, qs, ks, vs, mask, scaling=scaling)
        else:
            out, _ = gemma2_eager(module, qs, ks, vs, mask, scaling=scaling, softcap=softcap)
        outs.append(out.transpose(1, 2))
    return torch.cat(outs, dim=2)


VARIANTS = {
    "window": {"window": 4},
    "window-longer-than-all": {"window": 64},
    "softcap": {"softcap": 1.5},
    "window-softcap": {"window": 4, "softcap": 1.5},
    "sinks": {"sinks": True},
    "window-sinks": {"window": 4, "sinks": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("lengths", [DISTINCT, SHARED], ids=["distinct", "shared"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
def test_variants_equal_transformers_eager_on_each_sequence(
    heads: int, kv_heads: int, lengths: list[int], variant: str
) -> None:
    g = torch.Generator().manual_seed(heads + kv_heads + len(lengths))
    total, dim = sum(lengths), 16
    q = torch.randn(1, heads, total, dim, generator=g, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, total, dim, generator=g, requires_grad=True) for _ in range(2))
    extras = dict(VARIANTS[variant])
    if extras.pop("sinks", False):
        extras["sinks"] = torch.randn(heads, generator=g).requires_grad_()
    leaves = (q, k, v, *([extras["sinks"]] if "sinks" in extras else []))
    out = varlen_sdpa(q, k, v, lengths, scale=None, **extras)
    want = _hf_eager(q, k, v, lengths, **{"window": None, "softcap": None, "sinks": None, **extras})
    assert_close(out, want.float(), atol=1e-5, rtol=1e-5)
    upstream = torch.randn(out.shape, generator=g)
    for got, exp in zip(
        torch.autograd.grad(out, leaves, upstream), torch.autograd.grad(want, leaves, upstream.double()), strict=True
    ):
        assert_close(got, exp.float(), atol=1e-5, rtol=1e-5)
    if variant != "window-longer-than-all":  # and the variant is not a no-op on these inputs
        assert float((out - varlen_sdpa(q, k, v, lengths, scale=None)).detach().abs().max()) > 1e-2


def test_windowed_short_half_precision_sequences_attend_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """The float32-below-FLOAT32_BELOW rule holds on the windowed path too; sequences within the window
    stay on the plain causal path (one sdpa call per distinct length either way)."""
    seen = _sdpa_dtypes(monkeypatch)
    g = torch.Generator().manual_seed(3)
    lengths = [20, 3, 20]
    q, k, v = (torch.randn(1, 2, sum(lengths), 16, generator=g) for _ in range(3))
    want = _hf_eager(q, k, v, lengths, window=5, softcap=None, sinks=None)
    half = varlen_sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16(), lengths, scale=None, window=5)
    assert half.dtype == torch.bfloat16 and seen == [torch.float32] * 2
    assert_close(half.double(), want, atol=2e-2, rtol=2e-2)


def test_rows_of_a_batch_get_the_window_softcap_and_sinks() -> None:
    """Several rows (no packing) go through the same variants, row by row."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 12, 8, generator=g)
    k, v = (torch.randn(3, 2, 12, 8, generator=g) for _ in range(2))
    sinks = torch.randn(4, generator=g)
    out, _ = varlen_attention_forward(None, q, k, v, None, sliding_window=5, s_aux=sinks)
    for row in range(3):
        one = [x[row : row + 1] for x in (q, k, v)]
        want = _hf_eager(*one, [12], window=5, softcap=None, sinks=sinks)
        assert_close(out[row : row + 1].transpose(1, 2), want.float(), atol=1e-5, rtol=1e-5)


class _Attention(torch.nn.Module):
    def __init__(self, *, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


def test_what_varlen_attention_still_refuses() -> None:
    x = torch.randn(1, 4, 6, 8)
    causal = _Attention(is_causal=True)
    with pytest.raises(ValueError, match="attention mask"):
        varlen_attention_forward(causal, x, x, x, torch.ones(1, 1, 6, 6))
    with pytest.raises(NotImplementedError, match="dropout"):
        varlen_attention_forward(causal, x, x, x, None, dropout=0.1)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        varlen_attention_forward(_Attention(is_causal=False), x, x, x, None)
    with pytest.raises(ValueError, match="3 attention sinks for 4 query heads"):
        varlen_attention_forward(causal, x, x, x, None, s_aux=torch.zeros(3))
    # what it used to refuse now runs
    out, _ = varlen_attention_forward(causal, x, x, x, None, sliding_window=2, softcap=3.0, s_aux=torch.zeros(4))
    assert out.shape == (1, 6, 4, 8)


def _flash_semantics_varlen_attn(calls: list[dict]):  # type: ignore[no-untyped-def]
    """A CPU stand-in for ``torch.nn.attention.varlen.varlen_attn`` with its keyword-only parameters, reading
    ``window_size=(left, right)`` as flash-attn documents it: query ``i`` sees keys ``[i - left, i + right]``,
    ``-1`` unbounded."""

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                    enable_gqa=False, **unused):  # fmt: skip
        calls.append({"window_size": window_size, "enable_gqa": enable_gqa, "scale": scale})
        left, right = window_size
        rep = query.shape[1] // key.shape[1] if enable_gqa else 1
        outs = []
        for a, b in itertools.pairwise(cu_seq_q.tolist()):
            q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
            pos = torch.arange(b - a)
            behind = pos[:, None] - pos[None, :]
            seen = ((behind <= left) | (left < 0)) & ((-behind <= right) | (right < 0))
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scale).transpose(0, 1))
        return torch.cat(outs)

    return varlen_attn


@pytest.mark.parametrize("window", [None, 1, 5, 30])
def test_torch_kernel_gets_the_window_as_flash_reads_it(monkeypatch: pytest.MonkeyPatch, window: int | None) -> None:
    calls: list[dict] = []
    fake = _flash_semantics_varlen_attn(calls)
    monkeypatch.setattr(va, "_torch_varlen", lambda: fake)
    monkeypatch.setattr(va, "_torch_varlen_params", lambda: frozenset(inspect.signature(fake).parameters))
    g = torch.Generator().manual_seed(5)
    lengths = [9, 17, 9, 3]
    q = torch.randn(1, 4, sum(lengths), 8, generator=g)
    k, v = (torch.randn(1, 2, sum(lengths), 8, generator=g) for _ in range(2))
    cu = cu_seqlens_kwargs(lengths)["cu_seq_lens_q"]
    assert va.torch_kernel_fits(window=window, softcap=None, sinks=None)
    got = va.torch_varlen_sdpa(q, k, v, cu, max(lengths), scale=0.3, window=window)
    assert_close(got, varlen_sdpa(q, k, v, lengths, scale=0.3, window=window), atol=1e-5, rtol=1e-5)
    # a window as long as the longest sequence is plain causal, flash's (-1, 0)
    want = (window - 1, 0) if window is not None and window < max(lengths) else (-1, 0)
    assert calls == [{"window_size": want, "enable_gqa": True, "scale": 0.3}]


def test_torch_kernel_leaves_softcap_sinks_and_unsupported_windows_to_the_split_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(va, "_torch_varlen_params", lambda: frozenset({"window_size", "scale", "enable_gqa"}))
    assert va.torch_kernel_fits(window=None, softcap=None, sinks=None)
    assert va.torch_kernel_fits(window=4096, softcap=None, sinks=None)
    assert not va.torch_kernel_fits(window=None, softcap=50.0, sinks=None)
    assert not va.torch_kernel_fits(window=128, softcap=None, sinks=torch.zeros(4))
    monkeypatch.setattr(va, "_torch_varlen_params", lambda: frozenset({"is_causal"}))  # torch 2.10
    assert va.torch_kernel_fits(window=None, softcap=None, sinks=None)
    assert not va.torch_kernel_fits(window=4096, softcap=None, sinks=None)
    x = torch.randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match="no window_size"):
        va.torch_varlen_sdpa(x, x, x, cu_seqlens_kwargs([10])["cu_seq_lens_q"], 10, scale=None, window=4)
