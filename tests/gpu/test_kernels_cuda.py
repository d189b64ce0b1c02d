"""Optional GPU kernels against the plain paths they replace: Liger's fused layers, flash-attn's varlen."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from learner.logprobs import forward_micro_batch
from learner.parallelize import apply_liger, load_model
from tests.gpu.helpers import DEVICE, config, packed, samples

pytestmark = pytest.mark.gpu
CUDA = DEVICE


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_liger_kernels_give_the_plain_logprobs(tiny_model_dir: Path) -> None:
    cfg = config(tiny_model_dir)
    plain = load_model(cfg, CUDA).to(CUDA)
    fused = load_model(cfg, CUDA).to(CUDA)
    apply_liger(fused, CUDA)
    mb = packed(samples())
    with torch.no_grad():
        ref, ref_ent = forward_micro_batch(plain, mb, device=CUDA, with_entropy=True)
        got, got_ent = forward_micro_batch(fused, mb, device=CUDA, with_entropy=True)
    assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert_close(got_ent, ref_ent, atol=1e-4, rtol=1e-4)
    # Only that instance: a model of the same family built afterwards, on the CPU where Triton cannot run,
    # is the plain one (Liger also rebinds the family's modeling module; apply_liger puts it back).
    cpu = load_model(cfg, torch.device("cpu"))
    assert not any("liger" in type(m).__module__ for m in cpu.modules())
    with torch.no_grad():
        cpu_lp, _ = forward_micro_batch(cpu, mb, device=torch.device("cpu"), with_entropy=True)
    assert_close(cpu_lp, ref.cpu(), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_attention_varlen_matches_the_sdpa_varlen_path(tiny_model_dir: Path) -> None:
    """Packed rows through flash-attn's varlen kernel and through tether's per-sequence SDPA, in bf16."""
    mb = packed(samples(8))
    out = {}
    for impl in ("flash_attention_2", "sdpa"):
        cfg = config(tiny_model_dir, attn=impl, use_remove_padding=True)
        model = load_model(cfg, CUDA).to(CUDA, dtype=torch.bfloat16)
        with torch.no_grad():
            out[impl] = forward_micro_batch(model, mb, device=CUDA)[0]
    assert_close(out["flash_attention_2"], out["sdpa"], atol=3e-2, rtol=3e-2)
