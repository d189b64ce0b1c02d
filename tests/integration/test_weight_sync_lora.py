"""LoRA weight sync end to end: adapter tensors only over gloo, merged into a real receiver's base weights.

The learner side is a peft model (as the learner trains it) with the tied embedding and the final norm
trained whole (``modules_to_save``), the receiver a transformers model loaded from the same ``model.path`` behind a real
Control gRPC server. The update must carry exactly the adapter and saved-module bytes, and afterwards the
receiver must compute what the learner's adapted model computes — also after
a second update (merged from the base again, not on top of the first) and on a server that starts late
and catches up from the adapter snapshot.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from learner.lora import adapter_params, apply_lora
from tests.integration.test_weight_sync_gloo import Fleet, fleet  # noqa: F401 - the fixture
from tests.weight_receiver import ModelEngine
from tether.config import TetherConfig
from weight_sync.sender import WeightSender

pytestmark = pytest.mark.timeout(120)
IDS = torch.tensor([[60, 61, 62, 63, 64, 65, 66, 67]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def _cfg(tmp_path: Path) -> TetherConfig:
    return TetherConfig.model_validate(
        {
            "run": {"run_id": "lora", "output_dir": str(tmp_path)},
            "model": {
                "lora": {
                    "rank": 4,
                    "alpha": 8,
                    "target_modules": "all-linear",
                    "modules_to_save": ["embed_tokens", "model.norm"],
                }
            },
            "weight_sync": {
                "transport": {"type": "gloo", "master_port": 0},
                "verify_checksums": True,
                "prepare_timeout_s": 10,
                "transfer_timeout_s": 20,
                "commit_timeout_s": 20,
            },
        }
    )


def test_lora_update_sends_adapters_only_and_the_receiver_computes_the_adapted_model(
    tmp_path: Path,
    tiny_model_dir: Path,
    fleet: Fleet,  # noqa: F811
) -> None:
    cfg = _cfg(tmp_path)
    torch.manual_seed(0)
    learner = apply_lora(ModelEngine.from_path(tiny_model_dir).model, cfg.model.lora)
    base_bytes = sum(p.numel() * p.element_size() for n, p in learner.named_parameters() if not p.requires_grad)
    params = adapter_params(learner)
    saved = [n for n, _ in params if ".lora_A.weight" not in n and ".lora_B.weight" not in n]
    assert saved == ["base_model.model.model.embed_tokens.weight", "base_model.model.model.norm.weight"]
    addresses = [fleet.add(tiny_model_dir, cfg)]
    engine = fleet.engines[0]
    before = logits(engine.model)
    sender = WeightSender(cfg, model=learner, params=params, servers=lambda: list(addresses))
    try:
        for version in (1, 2):
            with torch.no_grad():  # B starts at 0 (no change); random adapters make every update visible
                for n, p in params:
                    p.normal_(0, 0.05) if n not in saved else p.mul_(1 + 0.5 * torch.rand_like(p))
            metrics = sender.publish(version)
            assert metrics["weight_sync/reached"] == 1, sender.last_dropped
            lora_bytes = sum(p.numel() * p.element_size() for n, p in params if n not in saved)
            conf = learner.config  # one tied embedding copy and the final norm, float32
            saved_bytes = 4 * (conf.vocab_size * conf.hidden_size + conf.hidden_size)
            assert metrics["weight_sync/bytes"] == lora_bytes + saved_bytes < base_bytes / 2
            assert engine.policy_version == version
            expected = logits(learner)
            assert (expected - before).abs().max() > 1e-3  # the adapters do change the outputs
            assert_close(logits(engine.model), expected, atol=1e-5, rtol=1e-5)
        addresses.append(fleet.add(tiny_model_dir, cfg))  # starts late: the v2 adapter snapshot
        assert fleet.engines[1].policy_version == 2
        assert_close(logits(fleet.engines[1].model), logits(learner), atol=1e-5, rtol=1e-5)
    finally:
        sender.close()


def test_a_full_update_is_refused_under_a_lora_config(tmp_path: Path, tiny_model_dir: Path) -> None:
    from weight_sync.lora import AdapterApplier

    model = ModelEngine.from_path(tiny_model_dir).model
    with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
        AdapterApplier(2.0).load(model, list(model.named_parameters())[:1])
