"""The model's tool calls, read from the text it sampled (vLLM's ``--tool-call-parser``, the families tether runs).

* ``hermes`` — Qwen2.5/3 and Hermes: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``, any number, with
  free text around them (the text becomes the message's ``content``).
* ``llama3_json`` — Llama 3.1+: the whole reply is one JSON object ``{"name": …, "parameters": {…}}`` (or several
  joined by ``;``), optionally after ``<|python_tag|>``.

A reply that starts a call it does not finish or whose JSON does not parse is **malformed**: it comes back as
plain text and is counted, never half-parsed. Parsing changes only what the client reads: the trained ids are
the sampled ones, whatever the parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

Parser = Literal["hermes", "llama3_json", "none"]

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass
class Parsed:
    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI ``tool_calls`` entries: ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    malformed: bool = False


def parser_for(template: str | None, configured: str) -> Parser:
    """``rollout.openai.tool_call_parser`` resolved: ``auto`` reads what the chat template writes for a call."""
    if configured != "auto":
        return configured  # type: ignore[return-value]
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "none"


def _call(obj: Any, args_key: str) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments already as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _hermes(text: str) -> Parsed:
    if "<tool_call>" not in text:
        return Parsed(text)
    calls = []
    for body in _HERMES_CALL.findall(text):
        try:
            call = _call(json.loads(body), "arguments")
        except ValueError:
            call = None
        if call is None:
            return Parsed(text, malformed=True)
        calls.append(call)
    rest = _HERMES_CALL.sub("", text)
    if not calls or "<tool_call>" in rest:  # a call opened and never closed (ran out of tokens, or garbled)
        return Parsed(text, malformed=True)
    return Parsed(rest.strip() or None, calls)


def _llama3_json(text: str) -> Parsed:
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    elif not body.startswith("{"):
        return Parsed(text)
    calls = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError:
            return Parsed(text, malformed=True)
        call = _call(obj, "parameters")
        if call is None:
            return Parsed(text, malformed=True)
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    if not calls:
        return Parsed(text, malformed=True)
    return Parsed(None, calls)


def parse_tool_calls(text: str, parser: Parser) -> Parsed:
    """The reply ``text`` as OpenAI's ``content`` and ``tool_calls``."""
    if parser == "hermes":
        return _hermes(text)
    if parser == "llama3_json":
        return _llama3_json(text)
    return Parsed(text)
