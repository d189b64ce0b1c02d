"""``learner.enable_activation_offload`` on CUDA with gradient checkpointing: the step is the plain one,
and activations really went to the host; the critic (PPO with GAE) steps on CUDA like on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from learner.critic import build_critic
from learner.offload import ActivationOffload
from learner.parallelize import load_model, parallelize
from learner.synthetic import make_groups
from learner.trainer import Trainer
from tests.gpu.helpers import DEVICE, config, flat

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_rank")]


def _step(model_dir: Path, **learner: object) -> tuple[torch.Tensor, dict[str, float]]:
    torch.manual_seed(0)
    cfg = config(model_dir, param_dtype="float32", enable_gradient_checkpointing=True, **learner)
    model = parallelize(load_model(cfg, DEVICE), cfg, DEVICE)
    out = Trainer(cfg, model, device=DEVICE, ref_model=None).train_step(make_groups(4, 4, vocab=256, seed=3), version=0)
    return flat(model), out


def test_activation_offload_with_checkpointing_changes_nothing_but_where_activations_wait(tiny_model_dir: Path):
    if DEVICE.type != "cuda":
        pytest.skip("activation offload is CUDA only (on CPU it is ignored with a warning)")
    plain, m_plain = _step(tiny_model_dir)
    before = ActivationOffload.offloaded_bytes
    offloaded, m_off = _step(tiny_model_dir, enable_activation_offload=True)
    assert ActivationOffload.offloaded_bytes > before  # saved tensors really went through the host
    assert m_off["loss/pg"] == pytest.approx(m_plain["loss/pg"], rel=1e-5, abs=1e-6)
    assert_close(offloaded, plain, atol=1e-5, rtol=1e-4)


def test_gae_step_on_cuda_follows_the_cpu_step(tiny_model_dir: Path) -> None:
    outs = {}
    for device in (torch.device("cpu"), DEVICE):
        torch.manual_seed(0)
        cfg = config(tiny_model_dir, param_dtype="float32", device=device.type)
        cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"adv_estimator": "gae"})})
        model = parallelize(load_model(cfg, device), cfg, device)
        trainer = Trainer(cfg, model, device=device, ref_model=None, critic=build_critic(cfg, device))
        outs[device.type] = trainer.train_step(make_groups(4, 4, vocab=256, seed=3), version=0)
    cpu, gpu = outs["cpu"], outs[DEVICE.type]
    for k in ("critic/vf_loss", "critic/vf_explained_var", "loss/pg"):
        assert gpu[k] == pytest.approx(cpu[k], rel=1e-3, abs=1e-4), k
