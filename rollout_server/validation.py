"""Turn a request's prompt and sampling fields into engine inputs, or say exactly what is wrong.

Every check lives here so the servicer, episodes and the prompt worker reject the same things with
the same words; a :class:`BadRequest` carries the gRPC status code to answer with. Unset optional
fields fall back to the server's ``rollout`` defaults (the proto's "0 means the server default").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from rollout_server.engines.base import SamplingSpec
from tether.config import RolloutConfig
from tether.prompts import encode_prompt, render_chat
from tether.v1 import rollout_pb2


class BadRequest(Exception):
    """A request the server refuses; ``code`` is the gRPC status to answer with."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.code = code


def sampling_spec(s: rollout_pb2.SamplingParams, cfg: RolloutConfig, *, n_override: int | None = None) -> SamplingSpec:
    n = n_override if n_override is not None else (s.n or cfg.n)
    if n <= 0 or n > cfg.max_n:
        raise BadRequest(f"sampling.n: must be between 1 and {cfg.max_n} (rollout.max_n), got {n}")
    temperature = s.temperature if s.HasField("temperature") else cfg.temperature
    if not temperature >= 0:  # also catches NaN
        raise BadRequest(f"sampling.temperature: must be >= 0, got {temperature}")
    top_p = s.top_p if s.HasField("top_p") else cfg.top_p
    if not 0 < top_p <= 1:
        raise BadRequest(f"sampling.top_p: must be in (0, 1], got {top_p}")
    if s.top_k < -1:
        raise BadRequest(f"sampling.top_k: must be -1 or 0 (disabled) or positive, got {s.top_k}")
    max_tokens = s.max_tokens or cfg.max_tokens
    if max_tokens > cfg.max_tokens:
        raise BadRequest(
            f"sampling.max_tokens: {max_tokens} is above the server limit {cfg.max_tokens} (rollout.max_tokens)"
        )
    stop = tuple(x for x in s.stop if x)
    return SamplingSpec(
        n=n,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=s.top_k if s.top_k > 0 else (cfg.top_k if s.top_k == 0 else -1),
        max_tokens=max_tokens,
        stop=stop,
        seed=s.seed if s.HasField("seed") else None,
    )


def render_messages(tokenizer: Any, messages: Sequence[Any], *, add_generation_prompt: bool = True) -> str:
    if not messages:
        raise BadRequest("prompt: messages is empty")
    if getattr(tokenizer, "chat_template", None) is None:
        raise BadRequest("prompt: messages given, but the model's tokenizer has no chat template; send text")
    roles = {"system", "user", "assistant", "tool"}
    for i, m in enumerate(messages):
        if m.role not in roles:
            raise BadRequest(f"prompt.messages[{i}].role: {m.role!r} is not one of {', '.join(sorted(roles))}")
    chat = [{"role": m.role, "content": m.content} for m in messages]
    return render_chat(tokenizer, chat, add_generation_prompt=add_generation_prompt)


def encode(tokenizer: Any, text: str) -> list[int]:
    """A prompt's ids (raw text or a rendered chat template) by the one rule, :func:`tether.prompts.encode_prompt`:
    the tokenizer's BOS where it adds one and the text does not already begin with it, never a trailing EOS."""
    return encode_prompt(tokenizer, text)


def prompt_ids(req: Any, tokenizer: Any, cfg: RolloutConfig, *, vocab_size: int, max_model_len: int) -> list[int]:
    """Token ids of a GenerateRequest / OpenEpisodeRequest prompt (text, token_ids or messages)."""
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise BadRequest("prompt: empty — set text, token_ids or messages")
    if kind == "text":
        if not req.text:
            raise BadRequest("prompt.text: empty")
        ids = encode(tokenizer, req.text)
    elif kind == "token_ids":
        ids = check_vocab(list(req.token_ids.ids), vocab_size=vocab_size)
    else:
        ids = encode(tokenizer, render_messages(tokenizer, req.messages.messages))
    return check_length(ids, cfg, max_model_len=max_model_len)


def check_vocab(ids: list[int], *, vocab_size: int) -> list[int]:
    """``ids``, each inside the vocabulary; an id outside it would fail the engine's whole batch."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise BadRequest(f"prompt.token_ids: {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def check_length(ids: list[int], cfg: RolloutConfig, *, max_model_len: int) -> list[int]:
    if not ids:
        raise BadRequest("prompt: empty after tokenization")
    limit = min(cfg.max_prompt_len, max_model_len - 1)
    if len(ids) > limit:
        raise BadRequest(f"prompt: {len(ids)} tokens is longer than the limit of {limit} (rollout.max_prompt_len)")
    return ids
