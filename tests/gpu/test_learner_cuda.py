"""The learner on CUDA against its references: bf16 vs fp32 steps, CUDA vs CPU log-probs and entropy,
gradient checkpointing and CPU offload vs the plain step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from learner.logprobs import forward_micro_batch
from learner.parallelize import load_model, parallelize
from learner.synthetic import make_groups
from learner.trainer import Trainer
from tests.gpu.helpers import DEVICE, config, flat, packed, samples

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_rank")]
CUDA = DEVICE


def _step(model_dir: Path, **learner: object) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(weights before, weights after, metrics) of one learner step on a fixed batch."""
    torch.manual_seed(0)
    cfg = config(model_dir, **learner)
    device = CUDA
    model = parallelize(load_model(cfg, device), cfg, device)
    before = flat(model)
    out = Trainer(cfg, model, device=device, ref_model=None).train_step(make_groups(4, 4, vocab=256, seed=3), version=0)
    return before, flat(model), out


def test_bf16_step_follows_the_fp32_step(tiny_model_dir: Path) -> None:
    b32, a32, m32 = _step(tiny_model_dir, param_dtype="float32")
    b16, a16, m16 = _step(tiny_model_dir, param_dtype="bfloat16")
    assert_close(b16, b32)  # same start: master weights are fp32 either way
    assert m16["loss/pg"] == pytest.approx(m32["loss/pg"], rel=5e-2, abs=5e-3)
    d32, d16 = a32 - b32, a16 - b16
    cos = torch.nn.functional.cosine_similarity(d32, d16, dim=0).item()
    assert cos > 0.95, f"bf16 update points elsewhere than fp32 (cosine {cos:.3f})"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_and_entropy_on_cuda_match_cpu(tiny_model_dir: Path, dtype: str) -> None:
    cfg = config(tiny_model_dir)
    cpu_model = load_model(cfg, torch.device("cpu"))
    gpu_model = load_model(cfg, CUDA).to(CUDA, dtype=getattr(torch, dtype))
    mb = packed(samples())
    with torch.no_grad():
        lp_cpu, ent_cpu = forward_micro_batch(cpu_model, mb, device=torch.device("cpu"), with_entropy=True)
        lp_gpu, ent_gpu = forward_micro_batch(gpu_model, mb, device=CUDA, with_entropy=True)
    tol = {"float32": (1e-4, 1e-4), "bfloat16": (5e-2, 5e-2)}[dtype]
    assert lp_gpu.dtype == torch.float32  # log-softmax in fp32 whatever the compute dtype
    assert_close(lp_gpu.cpu(), lp_cpu, atol=tol[0], rtol=tol[1])
    assert_close(ent_gpu.cpu(), ent_cpu, atol=tol[0], rtol=tol[1])


def test_gradient_checkpointing_on_cuda_changes_nothing(tiny_model_dir: Path) -> None:
    _, plain, m_plain = _step(tiny_model_dir, param_dtype="float32")
    _, ckpt, m_ckpt = _step(tiny_model_dir, param_dtype="float32", enable_gradient_checkpointing=True)
    assert m_ckpt["loss/pg"] == pytest.approx(m_plain["loss/pg"], rel=1e-5, abs=1e-6)
    assert_close(ckpt, plain, atol=1e-5, rtol=1e-4)


def test_cpu_offload_step_equals_the_resident_step(tiny_model_dir: Path) -> None:
    _, resident, m_res = _step(tiny_model_dir, param_dtype="float32")
    _, offload, m_off = _step(tiny_model_dir, param_dtype="float32", cpu_offload=True)
    assert m_off["loss/pg"] == pytest.approx(m_res["loss/pg"], rel=1e-5, abs=1e-6)
    assert_close(offload, resident, atol=1e-5, rtol=1e-4)
