"""``learner.enable_activation_offload`` off CUDA: ignored, and said so in exactly one warning line."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from learner.offload import ActivationOffload, activation_offload
from tether.config import TetherConfig


def test_on_cpu_it_is_ignored_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    cfg = TetherConfig.model_validate({"learner": {"enable_activation_offload": True}})
    with caplog.at_level(logging.INFO):
        ctx = activation_offload(cfg, torch.device("cpu"))
    said = [r.getMessage() for r in caplog.records if "activation_offload" in r.getMessage()]
    assert ctx is contextlib.nullcontext and len(said) == 1 and "ignored" in said[0], said


def test_off_by_default_and_on_cuda_it_is_the_offload_hooks(caplog: pytest.LogCaptureFixture) -> None:
    assert activation_offload(TetherConfig(), torch.device("cuda")) is contextlib.nullcontext
    on = TetherConfig.model_validate(
        {"learner": {"enable_activation_offload": True, "enable_gradient_checkpointing": True}}
    )
    with caplog.at_level(logging.INFO):
        assert activation_offload(on, torch.device("cuda")) is ActivationOffload
    assert not [r for r in caplog.records if "activation_offload" in r.getMessage()]


def test_the_hooks_keep_cpu_tensors_and_parameters_where_they_are() -> None:
    weight = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3, requires_grad=True)
    with ActivationOffload():
        y = (x @ weight).sin().sum()
    y.backward()  # CPU tensors pass through untouched: the gradients are the plain ones
    x2, w2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (x2 @ w2).sin().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)
