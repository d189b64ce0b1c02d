"""A GGUF file to a bfloat16 Hugging Face folder: the work behind :func:`tether.model_path.resolve_model_path`.

    python -m tether.gguf_convert MODEL.gguf OUT_DIR

It runs as a child process of whoever resolves ``model.path`` (torch and transformers stay out of launchers),
under that process' lock, into a folder that is renamed into place only when complete. transformers
dequantizes the tensors and rebuilds the tokenizer from the GGUF's vocabulary (``gguf`` package); this adds
what that rebuild drops: whether a plain ``tokenizer(text)`` adds BOS/EOS (``tokenizer.ggml.add_bos_token``,
without which Gemma would be fed prompts without ``<bos>``) and the chat template, when the file has one.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any


def gguf_metadata(gguf: Path) -> dict[str, Any]:
    """The file's metadata (the keys this module reads are scalars and strings)."""
    try:  # transformers' own reader skips the 262k-string vocabulary in 0.1 s
        from transformers.integrations.gguf.reader import read_gguf_metadata

        metadata, _ = read_gguf_metadata(str(gguf))
        return metadata
    except ImportError:  # another transformers: the gguf package's reader (slower: it parses everything)
        from gguf import GGUFReader

        out: dict[str, Any] = {}
        for key, field in GGUFReader(str(gguf)).fields.items():
            if len(field.data) == 1:
                out[key] = field.contents()
        return out


def convert(gguf: Path, out: Path) -> None:
    """Write ``out``: the model in bfloat16 (safetensors), its tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    metadata = gguf_metadata(gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # dequantize=True: plain dense weights even where a GGUF matmul kernel is installed (packed ones cannot
    # be saved, and the learner trains dense weights anyway).
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
    )
    model.hf_quantizer = None  # the weights are dense now: save them as an ordinary checkpoint
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(torch.bfloat16)
    flags = _tokenizer_flags(tokenizer, metadata)
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template and not tokenizer.chat_template:
        tokenizer.chat_template = template
    _check_special_ids(model, tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # The flags live in tokenizer.json's post-processor: transformers 5 neither saves nor reloads add_bos_token
    # in tokenizer_config.json, so a reloaded tokenizer adds <bos> while its add_bos_token attribute reads False.
    tokenizer.save_pretrained(out)
    _check_saved(out, flags)


def _tokenizer_flags(tokenizer: Any, metadata: dict[str, Any]) -> dict[str, bool]:
    flags = {}
    for flag in ("add_bos_token", "add_eos_token"):
        value = metadata.get(f"tokenizer.ggml.{flag}")
        if isinstance(value, bool):
            setattr(tokenizer, flag, value)  # rebuilds the post-processor
        flags[flag] = bool(getattr(tokenizer, flag, False))
    return flags


def _check_special_ids(model: Any, tokenizer: Any) -> None:
    """bos/eos/pad ids the generation config lacks, from the tokenizer (so generation stops and pads right)."""
    gen = model.generation_config
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(gen, name, None) is None and getattr(tokenizer, name, None) is not None:
            setattr(gen, name, getattr(tokenizer, name))
            setattr(model.config, name, getattr(tokenizer, name))


def _check_saved(out: Path, flags: dict[str, bool]) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out)
    if getattr(config, "quantization_config", None):
        raise RuntimeError(f"{out}: the saved config still says the weights are quantized")
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("1, 2, 3").input_ids
    for flag, token_id, at in (
        ("add_bos_token", tokenizer.bos_token_id, 0),
        ("add_eos_token", tokenizer.eos_token_id, -1),
    ):
        if token_id is not None and (ids[at] == token_id) != flags[flag]:
            raise RuntimeError(f"{out}: the saved tokenizer does not follow the GGUF's {flag}={flags[flag]} ({ids})")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m tether.gguf_convert MODEL.gguf OUT_DIR", file=sys.stderr)
        return 2
    try:
        convert(Path(args[0]), Path(args[1]))
    except Exception as e:  # the traceback for whoever runs this by hand, then one line for model_path's message
        traceback.print_exc()
        print(f"{type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
