"""The transformers rollout engine on CUDA: its behaviour log-probs are those of a forward pass."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rollout_server.engines import SamplingSpec, build_engine
from tests.gpu.helpers import DEVICE
from tether.config import load_config

pytestmark = pytest.mark.gpu


async def test_cuda_engine_logprobs_match_a_forward_pass(tiny_model_dir: Path) -> None:
    overrides = ["--model.path", str(tiny_model_dir), "--model.dtype", "float32"]
    overrides += ["--rollout.engine.device", DEVICE.type]
    engine = build_engine(load_config(None, overrides))
    await engine.start()
    try:
        assert next(engine.model.parameters()).device.type == DEVICE.type
        prompts = [engine.tokenizer("digits:")["input_ids"], engine.tokenizer("a longer prompt")["input_ids"]]
        outs = await asyncio.gather(*(engine.generate(p, SamplingSpec(n=2, max_tokens=12, seed=1)) for p in prompts))
        for prompt, samples in zip(prompts, outs, strict=True):
            for s in samples:
                ids = torch.tensor([prompt + s.token_ids], device=DEVICE)
                with torch.no_grad():
                    logits = engine.model(ids).logits[0].float()
                ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
                ref = ref.gather(-1, torch.tensor(s.token_ids, device=DEVICE)[:, None]).squeeze(-1)
                torch.testing.assert_close(torch.tensor(s.logprobs), ref.cpu(), atol=1e-4, rtol=1e-4)
    finally:
        await engine.shutdown()
