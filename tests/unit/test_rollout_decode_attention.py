"""The engine's decode attention: the same numbers as transformers' sdpa (with its repeat_kv copy)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollout_server.engines.decode_attention import DECODE_SDPA, decode_sdpa_forward, register


class _Attn(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("q_len", [1, 3])
def test_matches_transformers_sdpa_on_random_inputs(groups: int, q_len: int) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(groups * 10 + q_len)
    batch, kv_heads, length, dim = 5, 2, 11, 8
    query = torch.randn(batch, kv_heads * groups, q_len, dim, generator=g)
    key = torch.randn(batch, kv_heads, length, dim, generator=g)
    value = torch.randn(batch, kv_heads, length, dim, generator=g)
    # Left padding of a different width per row, as in the engine's batch; every row keeps its last columns.
    mask = torch.arange(length)[None, :] >= torch.tensor([0, 3, 5, 1, 9])[:, None]
    mask = mask[:, None, None, :].expand(batch, 1, q_len, length)
    module = _Attn(groups)
    got, _ = decode_sdpa_forward(module, query, key, value, mask, scaling=dim**-0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    assert got.shape == want.shape == (batch, q_len, kv_heads * groups, dim)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_padded_decode_loop_gives_the_logits_of_plain_sdpa(tiny_model_dir: Path) -> None:
    """The tiny model has grouped-query attention (4 heads, 2 KV heads): the path that skips the copy."""
    from transformers import AutoModelForCausalLM, DynamicCache

    register()
    models = {
        impl: AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=impl).eval()
        for impl in ("sdpa", DECODE_SDPA)
    }
    assert models[DECODE_SDPA].config.num_key_value_heads < models[DECODE_SDPA].config.num_attention_heads
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (6, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[:3, :4] = 0
    logits = {}
    with torch.inference_mode():
        for impl, model in models.items():
            cache, step_mask = DynamicCache(config=model.config), mask
            pos = (mask.cumsum(-1) - 1).clamp(min=0)
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache)
            pos, steps = pos[:, -1:], []
            for _ in range(5):
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], dim=-1)
                pos = pos + 1
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                out = model(input_ids=nxt, attention_mask=step_mask, position_ids=pos, past_key_values=cache)
                steps.append(out.logits[:, -1])
            logits[impl] = torch.stack(steps)
    torch.testing.assert_close(logits[DECODE_SDPA], logits["sdpa"], atol=1e-4, rtol=1e-4)


async def test_the_engine_decodes_with_it(tiny_model_dir: Path) -> None:
    from rollout_server.engines import build_engine
    from tether.config import load_config

    engine = build_engine(load_config(None, ["--model.path", str(tiny_model_dir)]))
    await engine.start()
    try:
        assert engine.model.config._attn_implementation == DECODE_SDPA
    finally:
        await engine.shutdown()
