"""LoRA on the receiver against peft's own merge on random adapters, saved modules replaced whole, and
refusals: bad updates, unknown saved modules, a LoRA target tied to another module."""

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
        applier.load(plain, named)
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


def test_saved_module_tensors_replace_their_weight_whole() -> None:
    _, named, scale = _peft_pair()
    bias = torch.randn(12)
    update = [*named, ("base_model.model.0.bias", bias)]  # a module trained whole travels under its saved name
    plain = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 16))
    AdapterApplier(scale).load(plain, update)
    assert torch.equal(plain[0].bias, bias)
    base = [("0.weight", torch.zeros(12, 16)), ("0.bias", torch.ones(12)), ("1.weight", torch.zeros(16, 12))]
    assert torch.equal(dict(merged_checkpoint(update, lambda: iter(base), scale))["0.bias"], bias)
    with pytest.raises(ValueError, match="does not fit"):
        AdapterApplier(scale).load(plain, [("base_model.model.0.bias", torch.ones(3))])
    for frozen in ("base_model.model.0.base_layer.weight", "base_model.model.norm.original_module.weight"):
        with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
            target_name(frozen)


def test_apply_lora_refuses_unknown_saved_modules_and_tied_targets(tiny_model_dir) -> None:
    from transformers import AutoModelForCausalLM

    from learner.lora import adapter_params, apply_lora
    from tether.config.model import LoraConfig

    def model():
        return AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    with pytest.raises(ValueError, match="match no module"):
        apply_lora(model(), LoraConfig(modules_to_save=["nope"]))
    with pytest.raises(ValueError, match="tied embeddings"):
        apply_lora(model(), LoraConfig(target_modules=["q_proj", "lm_head"]))
    wrapped = apply_lora(model(), LoraConfig(modules_to_save=["lm_head"]))  # tied: one trained copy for both
    saved = [n for n, _ in adapter_params(wrapped) if ".lora_" not in n]
    assert saved == ["base_model.model.model.embed_tokens.weight"]
    inner = wrapped.base_model.model
    assert inner.lm_head.modules_to_save.default.weight is inner.model.embed_tokens.modules_to_save.default.weight


def test_demo_lora_config_is_the_documented_recipe() -> None:
    from pathlib import Path

    from tether.config import load_config

    cfg = load_config(Path(__file__).parents[2] / "configs" / "demo-lora.yaml", [])
    assert cfg.model.lora is not None and cfg.model.lora.modules_to_save == ["embed_tokens"]
    assert cfg.learner.data_path == "demo:charclass"
