"""Small helpers shared by tests: process liveness without races on zombies, a tiny random Qwen2 model."""

from __future__ import annotations

import os
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def tiny_qwen2(attn: str, *, max_position: int = 1024):
    """A 2-layer Qwen2 with GQA (4 heads, 2 kv heads) and seeded random weights, for attention numerics."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from learner.varlen_attention import register

    register()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position,
        attn_implementation=attn,
    )
    return Qwen2ForCausalLM(cfg)
