"""Tiny models for tests and the demo, built locally from a config: no hub, no network.

The tokenizer is byte-level (every UTF-8 byte is one token, plus a few special tokens), so any text
round-trips exactly; the model is a Qwen2-style decoder with random weights. Defaults keep
``head_dim >= 32``, which the CPU build of vLLM's attention requires.

    tether make-tiny-model /tmp/tiny --hidden 128 --layers 2 --heads 4
"""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    # ChatML; with tools, Hermes-style as Qwen2.5 writes it: the schemas in a system turn, each call the model
    # makes as <tool_call>{"name": …, "arguments": {…}}</tool_call> (what rollout.openai's `hermes` parser reads).
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Call one as <tool_call>{"name": <name>, "arguments": <object>}</tool_call><|im_end|>\n{% endif %}'
    "{% for message in messages %}{% if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """A byte-level ``PreTrainedTokenizerFast``: 256 byte tokens, then the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel uses)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def make_tiny_model(
    out_dir: str | Path,
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_position: int = 2048,
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a loadable model folder (config, safetensors weights, tokenizer, chat template)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if hidden % heads:
        raise ValueError(f"--hidden ({hidden}) must be divisible by --heads ({heads})")
    kv_heads = kv_heads or max(1, heads // 2)
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be divisible by --kv-heads ({kv_heads})")
    tokenizer = build_tokenizer()
    vocab_size = -(-len(tokenizer) // 64) * 64  # pad to a multiple of 64 for friendlier kernels
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out
