"""``model``: the policy model every process loads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from tether.config.base import Section


class LoraConfig(Section):
    """LoRA adapters on the actor (peft): only they train, only they travel to the rollout fleet."""

    rank: int = Field(default=8, gt=0)
    """Adapter rank r (verl: ``lora_rank``)."""

    alpha: float = Field(default=16.0, gt=0)
    """Scale numerator: the adapter adds ``alpha / rank * B @ A`` to each target weight (verl: ``lora_alpha``)."""

    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt (``q_proj``, ``v_proj``, ...) or ``all-linear`` (every linear layer but the LM
    head), as peft reads them (verl: ``target_modules``)."""

    dropout: float = Field(default=0.0, ge=0, lt=1)
    """Dropout on the adapter input in training forwards (peft ``lora_dropout``); it makes the update's
    log-probs noisy, so RL runs usually keep 0."""

    modules_to_save: list[str] = Field(default_factory=list)
    """Whole modules trained beside the adapters and sent with them in every weight update (peft and verl:
    ``modules_to_save``), matched as peft matches them: a module whose name ends with the entry, e.g.
    ``[embed_tokens]`` or ``[lm_head]`` (with ``tie_word_embeddings`` peft trains one tied copy for both,
    ``configs/demo-lora.yaml``) or ``[norm]`` (every RMSNorm weight)."""

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, v: list[str] | str) -> list[str] | str:
        if isinstance(v, list) and not v:
            raise ValueError("target_modules is empty: name the modules to adapt or use all-linear")
        return v

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


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

    def context_length(self, hf_config: object) -> int:
        """Prompt + completion tokens the model takes: ``max_model_len``, else ``hf_config``'s (the model
        folder's Hugging Face config) ``max_position_embeddings`` — the rollout engine's limit, which the
        learner's prompt check follows."""
        return self.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))

    lora: LoraConfig | None = None
    """Train LoRA adapters instead of the full actor (``{rank, alpha, target_modules, dropout,
    modules_to_save}``); weight updates then carry the adapter tensors (and the saved modules) only.
    Empty: full fine-tuning."""
