"""Packed rows through tether's varlen attention score like transformers' own padded eager forward, for every
family users train: Qwen2 (plain and with its sliding-window layers), Qwen3, Llama 3, Mistral (a global
sliding window), Gemma 2 (logit softcap, alternating windows), Gemma 3 (``layer_types``,
``query_pre_attn_scalar``) and gpt-oss (attention sinks, MoE, sliding layers).

Each family is a tiny random float32 model built from its real transformers config class, with windows
of 8 tokens and sequences up to 31, several to a row, some of one length (the split kernel batches those)
and some no longer than the window (the fast causal path). The packed side is the learner's own path
(:func:`learner.packing.make_micro_batch` then :func:`learner.logprobs.forward_micro_batch`, which passes
:func:`learner.varlen_attention.cu_seqlens_kwargs`); the reference is ``model(input_ids, attention_mask)``
on a right-padded batch with ``attn_implementation="eager"`` — transformers' masks and eager attention.

The comparisons can fail: the same packed forward with the window dropped, shifted by one token, or
without the softcap or the sinks is far off the reference on these inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from learner.logprobs import forward_micro_batch
from learner.packing import Sample, make_micro_batch
from learner.varlen_attention import register, varlen_attention_forward

WINDOW = 8
LENGTHS = [23, 5, 31, 8, 17, 31, 12, 2]  # longer and shorter than the window; 31 twice (one sdpa batch)
VOCAB = 128
CPU = torch.device("cpu")
SMALL = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # GQA everywhere
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # sharper attention than 0.02, so which keys a query sees shows in the log-probs
}


def _qwen2():  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config

    return Qwen2Config(num_hidden_layers=2, **SMALL)


def _qwen2_sliding():  # type: ignore[no-untyped-def]
    from transformers import Qwen2Config

    # Qwen's convention: layers from max_window_layers on slide.
    cfg = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **SMALL)
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    return cfg


def _qwen3():  # type: ignore[no-untyped-def]
    from transformers import Qwen3Config

    return Qwen3Config(num_hidden_layers=2, **SMALL)


def _llama3():  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return LlamaConfig(num_hidden_layers=2, rope_parameters=rope, **SMALL)


def _mistral():  # type: ignore[no-untyped-def]
    from transformers import MistralConfig

    return MistralConfig(num_hidden_layers=2, sliding_window=WINDOW, **SMALL)


def _gemma2():  # type: ignore[no-untyped-def]
    from transformers import Gemma2Config

    return Gemma2Config(
        num_hidden_layers=4,  # sliding, full, sliding, full
        sliding_window=WINDOW,
        attn_logit_softcapping=2.0,  # small enough to bite on random weights (Gemma 2 ships 50)
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=24,  # not head_dim: the scale must come from the layer
        **SMALL,
    )


def _gemma3():  # type: ignore[no-untyped-def]
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        **SMALL,
    )


def _gpt_oss():  # type: ignore[no-untyped-def]
    from transformers import GptOssConfig

    small = {**SMALL, "max_position_embeddings": 4096 * 32}  # what its YaRN factor 32 over 4096 implies
    return GptOssConfig(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        **small,
    )


FAMILIES: dict[str, Callable] = {
    "qwen2": _qwen2,
    "qwen2-sliding": _qwen2_sliding,
    "qwen3": _qwen3,
    "llama3": _llama3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gpt-oss": _gpt_oss,
}
WINDOWED = ["qwen2-sliding", "mistral", "gemma2", "gemma3", "gpt-oss"]


def _model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), attn_implementation="eager", dtype=torch.float32)
    for name, p in model.named_parameters():
        if name.endswith(".sinks"):  # trained sinks are O(1); the 0.1-std init would hardly show
            torch.nn.init.normal_(p, mean=0.0, std=1.5)
    return model.eval()


def _sequences() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, VOCAB, n) for n in LENGTHS]


def _samples(seqs: list[np.ndarray]) -> list[Sample]:
    """Everything after the first token is scored: every query position matters."""
    return [
        Sample(input_ids=s, prompt_len=1, behavior_logprobs=np.zeros(len(s) - 1), loss_mask=np.ones(len(s) - 1))
        for s in seqs
    ]


def _packed(model: torch.nn.Module, seqs: list[np.ndarray], attn: str) -> torch.Tensor:
    """Log-probs through the learner's packed path with ``attn`` as the model's attention."""
    model.set_attn_implementation(attn)
    mb = make_micro_batch(_samples(seqs), list(range(len(seqs))), packed=True)
    logprobs, _ = forward_micro_batch(model, mb, device=CPU)
    return logprobs


def _padded_eager(model: torch.nn.Module, seqs: list[np.ndarray]) -> torch.Tensor:
    """transformers' plain forward: a right-padded batch with an attention mask, eager attention."""
    model.set_attn_implementation("eager")
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.from_numpy(s)
        mask[row, : len(s)] = 1
    logp = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float().log_softmax(-1)
    per_token = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([per_token[row, : len(s) - 1] for row, s in enumerate(seqs)])


@functools.cache
def _ablated(drop: str) -> str:
    """A varlen attention that gets one thing wrong on purpose, registered under its own name."""
    from transformers import AttentionInterface

    def forward(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        if drop == "window":
            kwargs["sliding_window"] = None
        elif drop == "window+1":
            kwargs["sliding_window"] = kwargs["sliding_window"] + 1 if kwargs.get("sliding_window") else None
        else:
            kwargs[drop] = None
        return varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"tether_varlen_without_{drop}"
    AttentionInterface.register(name, forward)
    return name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_logprobs_equal_the_padded_eager_forward(family: str) -> None:
    model, seqs = _model(family), _sequences()
    with torch.no_grad():
        want = _padded_eager(model, seqs)
        got = _packed(model, seqs, register())
    assert got.shape == want.shape == (sum(LENGTHS) - len(LENGTHS),)
    assert_close(got, want, atol=1e-5, rtol=0)


ABLATIONS = [
    ("qwen2-sliding", "window"),
    ("mistral", "window"),
    ("mistral", "window+1"),
    ("gemma2", "window"),
    ("gemma2", "softcap"),
    ("gemma3", "window"),
    ("gemma3", "window+1"),
    ("gpt-oss", "window"),
    ("gpt-oss", "s_aux"),
]


@pytest.mark.parametrize(("family", "drop"), ABLATIONS, ids=[f"{f}-{d}" for f, d in ABLATIONS])
def test_the_comparison_sees_a_wrong_window_softcap_or_sinks(family: str, drop: str) -> None:
    """What the families test above rests on matters for these inputs: get it wrong and the log-probs move
    by far more than the 1e-5 they are held to."""
    model, seqs = _model(family), _sequences()
    with torch.no_grad():
        want = _padded_eager(model, seqs)
        wrong = _packed(model, seqs, _ablated(drop))
    assert float((wrong - want).abs().max()) > 1e-2


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt-oss"])
def test_packed_gradients_equal_the_padded_eager_gradients(family: str) -> None:
    """Backward through windows with softcap (Gemma 2) and with sinks (gpt-oss: the sinks' own gradient too)."""
    model, seqs = _model(family), _sequences()
    params = [p for p in model.parameters() if p.requires_grad]
    want = torch.autograd.grad(_padded_eager(model, seqs).sum(), params)
    got = torch.autograd.grad(_packed(model, seqs, register()).sum(), params)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, g, w in zip(names, got, want, strict=True):
        assert_close(g, w, atol=1e-4, rtol=1e-4, msg=name)
    if family == "gpt-oss":
        assert all(float(g.abs().max()) > 0 for n, g in zip(names, got, strict=True) if n.endswith(".sinks"))
