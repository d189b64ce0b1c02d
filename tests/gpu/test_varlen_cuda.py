"""The MFU levers on CUDA: torch's flash varlen kernel against tether's split kernel and a float64 reference,
and the learner's step with each lever against the step without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from learner import varlen_attention as va
from tests.gpu.helpers import DEVICE, ON_CPU

pytestmark = pytest.mark.gpu
needs_kernel = pytest.mark.skipif(
    not va.torch_varlen_available(DEVICE),
    reason=f"torch.nn.attention.varlen cannot run here ({DEVICE}, torch {torch.__version__})",
)
on_cuda_only = pytest.mark.skipif(ON_CPU, reason="compiling on the CPU is tests/unit/test_learner_mfu_levers.py's")


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int], scale: float, window: int | None = None
) -> torch.Tensor:
    """Causal attention per sequence in float64 on the CPU, GQA by repeating heads; ``window`` as
    transformers' ``sliding_window`` (keys ``0 <= i - j < window``)."""
    q, k, v = (x.double().cpu() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    outs, at = [], 0
    for n in lengths:
        s = slice(at, at + n)
        mask = va.window_mask(n, window, torch.device("cpu"))
        outs.append(F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], attn_mask=mask, scale=scale))
        at += n
    return torch.cat(outs, dim=2)


@needs_kernel
def test_torch_varlen_kernel_matches_the_split_kernel_and_float64() -> None:
    torch.manual_seed(0)
    lengths = [700, 1, 333, 1500, 333, 64]  # a length repeated (the split kernel batches it), a single token
    total = sum(lengths)
    q = torch.randn(1, 14, total, 64, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, total, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    scale = 64**-0.5
    cu = va.cu_seqlens_kwargs(lengths, DEVICE)["cu_seq_lens_q"]
    got = va.torch_varlen_sdpa(q, k, v, cu, max(lengths), scale=scale)
    split = va.varlen_sdpa(q, k, v, lengths, scale=scale)
    ref = _reference(q, k, v, lengths, scale)
    err = lambda x: float((x.double().cpu() - ref).norm() / ref.norm())  # noqa: E731
    assert got.shape == split.shape == q.shape
    assert err(got) < 1e-2 and err(split) < 1e-2, (err(got), err(split))


@needs_kernel
@pytest.mark.parametrize("window", [1, 128, 512])
def test_torch_varlen_kernel_takes_the_sliding_window(window: int) -> None:
    """transformers' ``sliding_window=W`` as flash's ``window_size=(W - 1, 0)``: the kernel, the split
    kernel and a float64 reference agree; sequences no longer than W are plain causal."""
    if not va.torch_kernel_fits(window=window, softcap=None, sinks=None):
        pytest.skip(f"torch {torch.__version__}'s varlen_attn has no window_size (the split kernel runs windows)")
    torch.manual_seed(1)
    lengths = [700, 1, 333, 1500, 128, 64]
    total = sum(lengths)
    q = torch.randn(1, 14, total, 64, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, total, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    scale = 64**-0.5
    cu = va.cu_seqlens_kwargs(lengths, DEVICE)["cu_seq_lens_q"]
    got = va.torch_varlen_sdpa(q, k, v, cu, max(lengths), scale=scale, window=window)
    split = va.varlen_sdpa(q, k, v, lengths, scale=scale, window=window)
    ref = _reference(q, k, v, lengths, scale, window=window)
    err = lambda x: float((x.double().cpu() - ref).norm() / ref.norm())  # noqa: E731
    assert err(got) < 1e-2 and err(split) < 1e-2, (err(got), err(split))
    causal = _reference(q, k, v, lengths, scale)
    assert float((ref - causal).norm() / causal.norm()) > 0.05  # the window matters for these inputs


@needs_kernel
def test_softcap_and_sinks_on_the_torch_kernel_run_the_split_kernel() -> None:
    """The flash kernel has no softcap and no sinks: those layers fall back to the split kernel, bit for bit."""
    torch.manual_seed(2)
    lengths = [300, 1, 77, 300]
    total = sum(lengths)
    q = torch.randn(1, 8, total, 64, device=DEVICE, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, total, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    sinks = torch.randn(8, device=DEVICE, dtype=torch.bfloat16)
    kw = va.cu_seqlens_kwargs(lengths, DEVICE)
    for extras in ({"softcap": 2.0}, {"s_aux": sinks}, {"sliding_window": 64, "s_aux": sinks}):
        got, _ = va.varlen_attention_forward(None, q, k, v, None, scaling=0.125, kernel="torch", **kw, **extras)
        want, _ = va.varlen_attention_forward(None, q, k, v, None, scaling=0.125, kernel="split", **kw, **extras)
        assert torch.equal(got, want), extras


def _step(model_dir: Path, **learner):  # type: ignore[no-untyped-def]
    from learner.parallelize import load_actor, parallelize
    from learner.synthetic import make_groups
    from learner.trainer import Trainer
    from tests.gpu.helpers import config

    cfg = config(model_dir, use_remove_padding=True, param_dtype="bfloat16", lr=1e-2, **learner)
    torch.manual_seed(0)
    model = parallelize(load_actor(cfg, DEVICE), cfg, DEVICE)
    trainer = Trainer(cfg, model, device=DEVICE, ref_model=None)
    grads: dict[str, torch.Tensor] = {}

    def keep(*_) -> None:  # type: ignore[no-untyped-def]
        from torch.distributed.tensor import DTensor

        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[n.replace("_orig_mod.", "")] = g.detach().float().cpu()

    trainer.optimizer.register_step_pre_hook(keep)
    metrics = trainer.train_step(make_groups(4, 4, vocab=256, seed=0), version=1)
    return metrics, grads


@pytest.mark.parametrize(
    "lever",
    [
        pytest.param({"varlen_attention": "torch"}, marks=needs_kernel, id="torch-varlen"),
        pytest.param({"use_torch_compile": True}, marks=on_cuda_only, id="compile"),
        pytest.param({"shard_single_rank": True}, id="fsdp-one-rank"),
        pytest.param({"use_fused_kernels": True}, id="fused-lm-head"),
    ],
)
def test_a_bf16_step_with_each_lever_agrees_with_the_baseline(
    one_rank: None, tiny_model_dir: Path, lever: dict
) -> None:
    ref, ref_grads = _step(tiny_model_dir, varlen_attention="split")
    got, grads = _step(tiny_model_dir, **{"varlen_attention": "split", **lever})
    for key in ("loss/pg", "loss/total"):
        assert abs(got[key] - ref[key]) <= 0.02 * abs(ref[key]) + 1e-3, (key, got[key], ref[key])
    assert grads.keys() == ref_grads.keys() and grads
    cos = min(float(F.cosine_similarity(g.flatten(), ref_grads[n].flatten(), dim=0)) for n, g in grads.items())
    assert cos > 0.98, cos
