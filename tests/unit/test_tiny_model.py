"""The tiny model: loadable by transformers, generates, and its tokenizer round-trips any UTF-8."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tether.commands.tiny_model import SPECIAL_TOKENS, build_tokenizer

TOKENIZER = build_tokenizer()
_SPECIAL = re.compile("(" + "|".join(map(re.escape, SPECIAL_TOKENS)) + ")")


def _expected_ids(text: str) -> list[int]:
    """Byte-level: one token per UTF-8 byte, except that a special token's spelling is that one token (as
    Hugging Face tokenizers encode added special tokens found in text)."""
    ids: list[int] = []
    for i, part in enumerate(_SPECIAL.split(text)):
        if i % 2:
            ids.append(TOKENIZER.convert_tokens_to_ids(part))
        else:
            ids += list(part.encode("utf-8"))  # byte b is token id b
    return ids


# Plain text, and text with special-token spellings mixed in (hypothesis draws them too, from constants).
_TEXT = st.lists(st.one_of(st.text(), st.sampled_from(SPECIAL_TOKENS)), max_size=4).map("".join)


@settings(max_examples=200, deadline=None)
@given(text=_TEXT)
@example(text="<|im_end|>")
@example(text="a<|im_start|>b<|im_end")
def test_tokenizer_round_trips_any_text(text: str) -> None:
    ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    assert ids == _expected_ids(text)
    assert TOKENIZER.decode(ids) == text
    plain = _SPECIAL.sub("", text)
    assert len(TOKENIZER(plain, add_special_tokens=False)["input_ids"]) == len(plain.encode("utf-8"))


def test_chat_template_and_special_tokens() -> None:
    rendered = TOKENIZER.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = TOKENIZER(rendered, add_special_tokens=False)["input_ids"]
    assert TOKENIZER.convert_tokens_to_ids("<|im_start|>") in ids
    assert TOKENIZER.eos_token == "<|im_end|>"


@pytest.mark.slow
def test_cli_makes_a_model_transformers_loads_and_generates(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "m"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tether",
            "make-tiny-model",
            str(out),
            "--hidden",
            "64",
            "--layers",
            "1",
            "--heads",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.hidden_size == 64 and model.config.num_hidden_layers == 1
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    prompt = tokenizer("héllo 🌍", return_tensors="pt")
    torch.manual_seed(0)
    generated = model.generate(**prompt, max_new_tokens=8, do_sample=True, min_new_tokens=8)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 8
    assert tokenizer.decode(prompt["input_ids"][0]) == "héllo 🌍"


def test_bad_shape_is_a_clear_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tether", "make-tiny-model", str(tmp_path / "m"), "--hidden", "100", "--heads", "3"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "must be divisible" in result.stderr and "Traceback" not in result.stderr
