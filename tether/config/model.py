"""``model``: the policy model every process loads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from tether.config.base import Section


class ModelConfig(Section):
    path: str = ""
    """Local folder of a Hugging Face causal LM (config.json, weights, tokenizer). tether never
    downloads from a hub: make a tiny one with ``tether make-tiny-model DIR``."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights dtype for inference engines. ``auto``: bfloat16 on GPU, float32 on CPU."""

    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel for transformers models (learner and the transformers engine)."""

    max_model_len: int | None = Field(default=None, gt=0)
    """Longest prompt + completion in tokens; empty means the model config's
    ``max_position_embeddings``."""

    trust_remote_code: bool = False
    """Allow model folders that ship their own modelling code."""
