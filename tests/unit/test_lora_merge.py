"""LoRA merging on the receiver against peft's own merge, on random adapters; bad updates are refused."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from weight_sync.lora import AdapterApplier, adapter_pairs, merged_checkpoint, target_name


def _peft_pair(rank: int = 4, alpha: float = 8.0):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 16))
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha, target_modules=["0", "1"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.3)
    named = [(n.replace(".default.", "."), p.detach().clone()) for n, p in model.named_parameters() if "lora_" in n]
    return model, named, alpha / rank


def test_applier_equals_peft_merge_and_does_not_compound() -> None:
    model, named, scale = _peft_pair()
    plain = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 16))
    plain.load_state_dict({k.replace("base_layer.", ""): v for k, v in model.base_model.model.state_dict().items()
                           if "lora_" not in k})  # fmt: skip
    applier = AdapterApplier(scale)
    for _ in range(2):  # a second identical update lands on the base again, not on the first merge
        applier.load(plain, named, sums=False)
    merged = model.merge_and_unload()
    for (name, want), got in zip(merged.state_dict().items(), plain.state_dict().values(), strict=True):
        assert_close(got, want, atol=1e-6, rtol=1e-6, msg=name)


def test_merged_checkpoint_rewrites_only_adapted_weights() -> None:
    _, named, scale = _peft_pair()
    base = [("0.weight", torch.zeros(12, 16)), ("0.bias", torch.ones(12)), ("1.weight", torch.zeros(16, 12))]
    out = dict(merged_checkpoint(named, lambda: iter(base), scale))
    pairs = adapter_pairs(named)
    assert_close(out["0.weight"], scale * pairs["0.weight"]["B"] @ pairs["0.weight"]["A"])
    assert torch.equal(out["0.bias"], torch.ones(12))
    with pytest.raises(KeyError, match="does not hold"):
        list(merged_checkpoint(named, lambda: iter(base[:2]), scale))


def test_bad_updates_are_refused_with_a_message() -> None:
    with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
        target_name("model.layers.0.self_attn.q_proj.weight")
    _, named, _ = _peft_pair()
    with pytest.raises(ValueError, match="without lora_B"):
        adapter_pairs([p for p in named if ".lora_B." not in p[0]])
