"""``apply_liger`` patches the one model it is given, not the model family for the rest of the process.

Liger's ``_apply_liger_kernel_to_instance`` also rebinds classes and functions in the family's modeling
module, so a model built afterwards (on the CPU, where Triton kernels cannot run) got them too — seen on an
H200, where the next CPU forward failed. Here Liger is stood in for by a function that does both things the
real one does (it needs a GPU to run), so the check runs anywhere and fails if the module stays rebound.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
from transformers.models.qwen2 import modeling_qwen2

from learner.parallelize import apply_liger
from tether.commands.tiny_model import make_tiny_model


class _FakeLigerNorm(torch.nn.Module):
    pass


def test_apply_liger_leaves_the_modeling_module_as_it_was(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_apply(*, model: torch.nn.Module, **_: object) -> None:
        modeling_qwen2.Qwen2RMSNorm = _FakeLigerNorm  # what Liger does to the module
        modeling_qwen2.apply_rotary_pos_emb = lambda *a, **k: None
        model.model.norm.__class__ = _FakeLigerNorm  # and to the instance

    fake = types.ModuleType("liger_kernel.transformers")
    fake._apply_liger_kernel_to_instance = fake_apply  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    norm, rope = modeling_qwen2.Qwen2RMSNorm, modeling_qwen2.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_qwen2, "Qwen2RMSNorm", norm)  # put back at teardown even if the check fails
    monkeypatch.setattr(modeling_qwen2, "apply_rotary_pos_emb", rope)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path / "m", hidden=32, layers=1, heads=2))
    apply_liger(model, torch.device("cuda"))  # the device is only checked, nothing runs on it
    assert type(model.model.norm) is _FakeLigerNorm  # the instance keeps its kernels
    assert modeling_qwen2.Qwen2RMSNorm is norm and modeling_qwen2.apply_rotary_pos_emb is rope


def test_apply_liger_refuses_the_cpu() -> None:
    with pytest.raises(RuntimeError, match="needs a GPU"):
        apply_liger(torch.nn.Linear(1, 1), torch.device("cpu"))
