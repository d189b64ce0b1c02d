"""The transformers rollout engine on CUDA: its behaviour log-probs are those of a forward pass, also for a
request that joined a running batch (the per-row cache re-layout on the device)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rollout_server.engines import SamplingSpec, build_engine
from rollout_server.engines.decode_attention import DECODE_SDPA
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
        # The regrouped decode attention is for the CPU; on CUDA it was 17x slower than transformers' sdpa.
        assert engine.model.config._attn_implementation == ("sdpa" if DEVICE.type == "cuda" else DECODE_SDPA)
        # cuDNN's sdpa plans per shape, and each decode step has a new KV length (0.10x model.generate, H200).
        assert not (DEVICE.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled())
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


async def test_cuda_request_joining_a_running_batch_keeps_exact_logprobs(tiny_model_dir: Path) -> None:
    overrides = ["--model.path", str(tiny_model_dir), "--model.dtype", "float32"]
    overrides += ["--rollout.engine.device", DEVICE.type]
    engine = build_engine(load_config(None, overrides))
    await engine.start()
    try:
        engine._eos.clear()  # full-length rows: the long request is still running when the short one is done
        short, long = engine.tokenizer("x")["input_ids"], engine.tokenizer("a much longer prompt here")["input_ids"]
        running = asyncio.create_task(engine.generate(short, SamplingSpec(n=2, max_tokens=200, seed=2)))
        while not engine._rows or len(engine._rows[0].generated) < 3:
            await asyncio.sleep(0.001)
        (joined,) = await engine.generate(long, SamplingSpec(n=1, max_tokens=5, seed=3))
        assert not running.done()
        for prompt, s in [(long, joined), *((short, x) for x in await running)]:
            ids = torch.tensor([prompt + s.token_ids], device=DEVICE)
            with torch.no_grad():
                logits = engine.model(ids).logits[0].float()
            ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
            ref = ref.gather(-1, torch.tensor(s.token_ids, device=DEVICE)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref.cpu(), atol=1e-4, rtol=1e-4)
    finally:
        await engine.shutdown()
