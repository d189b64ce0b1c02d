"""A prompt's token ids, worked out in one place: the learner, the rollout servers' checks, the engines' callers
and the tools all call these functions, so the ids trained on are exactly the ids the engine saw.

The rule is HF's ``tokenizer(text)`` with two corrections:

* **A raw string gets the tokenizer's own leading special tokens** — BOS where the tokenizer adds one
  (Gemma's ``<bos>``, Llama 3's ``<|begin_of_text|>``), nothing where it adds none (Qwen, tether's byte
  tokenizer) — **but never twice**: text that already begins with them (a rendered chat template spells its
  own ``<bos>``) gets nothing more. Gemma fed a prompt without ``<bos>`` produces noise; one fed two is off
  the distribution it was trained on too.
* **No trailing special tokens**: a prompt is continued by the model, so an ``add_eos_token`` tokenizer's
  EOS is never appended.

The leading tokens are found once per tokenizer object by encoding a probe with and without special tokens
(:func:`prompt_prefix`) rather than read from ``add_bos_token``: in transformers 5 the post-processor in
``tokenizer.json`` decides what is added, and the attribute may not say it (a reloaded Llama 3 or GGUF-built
Gemma tokenizer adds BOS while ``add_bos_token`` reads False).

Chat messages are rendered by the tokenizer's chat template (:func:`render_chat`), which spells its special
tokens, then encoded by the same rule. Text that continues a sequence already under way — a multi-turn
episode's observation, an answer after its prompt — is :func:`encode_continuation`: no special tokens at all,
so no BOS lands in the middle of an episode.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

PROBE = "Hello world 12"
"""Text encoded with and without special tokens to see what the tokenizer adds around it."""


class _Prefix(NamedTuple):
    ids: tuple[int, ...]
    lead: str  # the text of the first prefix token ("<bos>"): a text not beginning with it cannot hold the prefix


_prefixes: weakref.WeakKeyDictionary[Any, _Prefix] = weakref.WeakKeyDictionary()


def prompt_prefix(tokenizer: Any) -> tuple[int, ...]:
    """The special-token ids ``tokenizer(text)`` puts before the text (``(bos_id,)`` or ``()``), worked out once
    per tokenizer object. A tokenizer changed after its first use (``add_bos_token`` set) keeps its old prefix."""
    return _prefix(tokenizer).ids


def _prefix(tokenizer: Any) -> _Prefix:
    found = _prefixes.get(tokenizer)
    if found is None:
        ids = _find_prefix(tokenizer)
        lead = tokenizer.convert_ids_to_tokens(ids[0]) if ids else ""
        found = _prefixes[tokenizer] = _Prefix(ids, lead)
    return found


def _find_prefix(tokenizer: Any) -> tuple[int, ...]:
    plain = list(tokenizer(PROBE, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(PROBE, add_special_tokens=True)["input_ids"])
    n = len(plain)
    for start in range(len(full) - n + 1):
        if full[start : start + n] == plain:
            return tuple(full[:start])
    # The special tokens also changed how the text itself is split: keep the leading special ids.
    special = set(getattr(tokenizer, "all_special_ids", ()))
    lead: list[int] = []
    for t in full:
        if t not in special:
            break
        lead.append(t)
    return tuple(lead)


def _missing(prefix: _Prefix, text: str, ids: Callable[[], Sequence[int]]) -> int:
    """How many ids to add before ``text``'s own: the prefix's length unless the text's ids already begin with
    it. The ids are looked at only when the text begins with the prefix's text: reading an encoding's ids
    builds a list of all of them, which cost the length scan ~10 %."""
    k = len(prefix.ids)
    if not k or (text.lstrip().startswith(prefix.lead) and tuple(ids()[:k]) == prefix.ids):
        return 0
    return k


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """The ids of a prompt given as text (raw, or a rendered chat template): the tokenizer's leading special
    tokens unless the text already begins with them, then the text; never a trailing EOS."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    prefix = _prefix(tokenizer)
    if _missing(prefix, text, lambda: ids):
        return [*prefix.ids, *ids]
    return ids


def encode_continuation(tokenizer: Any, text: str) -> list[int]:
    """The ids of text that continues a sequence already under way (an episode's observation, an answer after
    its prompt): no special tokens added, whatever the tokenizer's settings."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


CHAT_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")
"""The message keys a chat template is given: OpenAI's, which Hugging Face templates read for tool use."""


def render_chat(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """Chat messages (``{role, content}``, and for tool use ``tool_calls`` / ``tool_call_id`` / ``name``) through
    the tokenizer's chat template, as text; ``tools`` (OpenAI's function schemas) go to the template, which
    describes them to the model in its own words. The caller checks the tokenizer has a template and the roles
    are ones it takes, and says so in its own words."""
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(
        [{k: m[k] for k in CHAT_KEYS if m.get(k) is not None} | {"content": m.get("content") or ""} for m in messages],
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **extra,
    )


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True) -> list[int]:
    """The ids of a chat prompt: :func:`render_chat`, then :func:`encode_prompt` (the template's own ``<bos>``
    is kept, never doubled)."""
    return encode_prompt(tokenizer, render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt))


def count_prompt_tokens(tokenizer: Any, texts: list[str]) -> list[int]:
    """``len(encode_prompt(tokenizer, t))`` for each text, fast: a fast tokenizer's own batch encoder counts
    without building the id and mask lists ``tokenizer(texts)`` returns (1.7x faster on GSM8K rows)."""
    prefix = _prefix(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [len(ids) + _missing(prefix, t, lambda ids=ids: ids) for t, ids in zip(texts, encoded, strict=True)]
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    encodings = encode(texts, add_special_tokens=False)
    if not prefix.ids:
        return [len(e) for e in encodings]
    return [len(e) + _missing(prefix, t, lambda e=e: e.ids) for t, e in zip(texts, encodings, strict=True)]
