"""HTTP chat sessions as episodes, token-exact.

A request that names an episode (``X-Tether-Episode``) continues that episode's record: the client's messages
are compared, message by message, with the transcript it was shown (its own messages and our replies, kept
normalised in ``Episode.seen``). When they extend it, only the new messages are rendered by the chat template and
appended as environment tokens; the model's earlier turns stay the ids it sampled, never re-encoded text. When
they do not (the client edited, dropped or retried a turn), the episode **branches**: the record is cut back to
the last model turn both transcripts share (or started again from the client's messages when they share none),
the cut part is dropped and counted (``tether_rollout_episode_branches``), and the turn goes on from there.

A turn is all or nothing: if its generation fails or the client goes away, the record is put back as it was.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_server.engines.base import FINISH_STOP, Completion, SamplingSpec
from rollout_server.episodes import Episode, EpisodeStore, Mark, chat_continuation
from rollout_server.openai_api.schemas import ChatMessage
from rollout_server.validation import BadRequest, check_length
from tether.prompts import encode_continuation, encode_prompt, render_chat

TEMPLATE_ROLES = {"developer": "system"}
"""OpenAI's newer role names as chat templates know them."""


def seen_entry(m: ChatMessage) -> tuple:
    """A message as compared between requests: role, text, and each tool call's name and parsed arguments (ids
    and formatting are the client's business)."""
    calls = tuple((c.function.name, _canonical(c.function.arguments)) for c in m.tool_calls or ())
    return (TEMPLATE_ROLES.get(m.role, m.role), m.text(), calls, m.tool_call_id or "")


def reply_entry(content: str | None, calls: list[dict[str, Any]]) -> tuple:
    """Our reply as :func:`seen_entry` will read it when the client sends it back."""
    parsed = tuple((c["function"]["name"], _canonical(c["function"]["arguments"])) for c in calls)
    return ("assistant", content or "", parsed, "")


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A client message as the chat template reads it (tool calls with their arguments as objects)."""
    out: dict[str, Any] = {"role": TEMPLATE_ROLES.get(m.role, m.role), "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [
            {"type": "function", "id": c.id, "function": {"name": c.function.name, "arguments": _arguments(c)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _arguments(call: Any) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments


@dataclass
class Turn:
    """One model turn of an episode, prepared: what to generate from, and how to undo it."""

    ep: Episode
    context: list[int]
    spec: SamplingSpec
    seen: list[tuple]
    undo: Mark | None  # None: the episode was created for this turn (a failure discards it)
    branched: bool
    dropped_tokens: int = 0


class ChatSessions:
    def __init__(self, store: EpisodeStore) -> None:
        self.store = store
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def lock(self, name: str) -> asyncio.Lock:
        """One turn of an episode at a time, its first request included (two would open it twice)."""
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    def prepare_text(
        self, name: str, prompt: str, spec: SamplingSpec, *, group_id: str, group_size: int, metadata: dict[str, str]
    ) -> Turn:
        """A text episode's next turn (``/v1/completions``): the prompt must begin with the text the client was
        shown (earlier prompts and our completions); only the rest is encoded, as a continuation. Any other
        prompt starts the episode again (a branch)."""
        ep = self.store.lookup(name)
        if ep is not None and ep.messages is not None:
            raise BadRequest(f"episode {name!r} is a chat episode; continue it on /v1/chat/completions")
        shown = ep.seen[0] if ep is not None and ep.seen else None
        if ep is not None and shown is not None and prompt.startswith(shown):
            _check_temperature(ep, spec)
            rest = prompt[len(shown) :]
            return self._extend(ep, lambda: encode_continuation(self.tokenizer, rest), [prompt], spec, branched=False)
        dropped = self._drop(ep)
        return self._open(
            name,
            encode_prompt(self.tokenizer, prompt),
            None,
            None,
            [prompt],
            spec,
            dropped=dropped,
            group_id=group_id,
            group_size=group_size,
            metadata=metadata,
        )

    @property
    def tokenizer(self) -> Any:
        return self.store.state.engine.tokenizer

    def prepare(
        self,
        name: str,
        messages: list[ChatMessage],
        tools: list[dict[str, Any]] | None,
        spec: SamplingSpec,
        *,
        group_id: str,
        group_size: int,
        metadata: dict[str, str],
    ) -> Turn:
        """The next turn of episode ``name`` (opened here on its first request). Call under the episode's lock
        when it exists; follow with :meth:`commit` or :meth:`abandon`."""
        seen = [seen_entry(m) for m in messages]
        ep = self.store.lookup(name)
        if ep is not None:
            _check_same(ep, tools, spec)
            shared = _shared_prefix(seen, ep.seen)
            if shared == len(ep.seen):  # extends what the client was shown
                return self._continue(ep, messages[shared:], seen, spec, branched=False)
            mark = next((m for m in reversed(ep.marks) if m.seen <= shared), None)
            if mark is not None:
                dropped = len(ep.tokens) - mark.tokens
                self.store.rewind(ep, mark)
                turn = self._continue(ep, messages[mark.seen :], seen, spec, branched=True)
                turn.dropped_tokens = dropped
                return turn
        dropped = self._drop(ep)
        chat = [template_message(m) for m in messages]
        ids = encode_prompt(self.tokenizer, render_chat(self.tokenizer, chat, tools=tools))
        return self._open(
            name,
            ids,
            chat,
            tools,
            seen,
            spec,
            dropped=dropped,
            group_id=group_id,
            group_size=group_size,
            metadata=metadata,
        )

    def _drop(self, ep: Episode | None) -> int | None:
        """Discard ``ep``, the record a fresh start replaces; the tokens it held (None: there was none)."""
        if ep is None:
            return None
        self.store.discard(ep.id)
        return len(ep.tokens)

    def _open(
        self,
        name: str,
        ids: list[int],
        chat: list[dict[str, Any]] | None,
        tools: list[dict[str, Any]] | None,
        seen: list,
        spec: SamplingSpec,
        *,
        dropped: int | None,
        group_id: str,
        group_size: int,
        metadata: dict[str, str],
    ) -> Turn:
        """A new record for episode ``name`` whose prompt is ``ids`` (a branch when it replaces one)."""
        s = self.store.state
        check_length(ids, s.cfg.rollout, max_model_len=s.engine.max_model_len)
        ep = self.store.create(name, ids, spec, chat, group_id, group_size, metadata, tools=tools)
        context, spec = self.store.next_turn(ep, spec)
        return Turn(ep, context, spec, seen, None, branched=dropped is not None, dropped_tokens=dropped or 0)

    def _continue(
        self, ep: Episode, new: list[ChatMessage], seen: list[tuple], spec: SamplingSpec, *, branched: bool
    ) -> Turn:
        chat = [template_message(m) for m in new]
        return self._extend(ep, lambda: chat_continuation(self.tokenizer, ep, chat), seen, spec, branched=branched)

    def _extend(
        self, ep: Episode, ids_of: Callable[[], list[int]], seen: list, spec: SamplingSpec, *, branched: bool
    ) -> Turn:
        """The record continued by ``ids_of()`` as environment tokens; put back as it was if that or the room
        check fails."""
        undo = Mark(len(ep.seen), len(ep.tokens), len(ep.messages or ()), ep.last_turn_stopped)
        try:
            self.store.observe(ep, ids_of())
            context, spec = self.store.next_turn(ep, spec)
        except BaseException:
            self.store.rewind(ep, undo)
            raise
        return Turn(ep, context, spec, seen, undo, branched)

    def commit(self, turn: Turn, sample: Completion, reply: tuple | str) -> None:
        """Record the turn; ``reply`` is what the client was shown of it (a chat reply's entry, or a text
        completion, which a text episode's next prompt must begin with)."""
        ep = turn.ep
        self.store.record(ep, sample)
        ep.seen = [turn.seen[0] + reply] if isinstance(reply, str) else [*turn.seen, reply]
        ep.marks.append(Mark(len(ep.seen), len(ep.tokens), len(ep.messages or ()), sample.finish_reason == FINISH_STOP))

    def abandon(self, turn: Turn) -> None:
        if turn.undo is None:
            self.store.discard(turn.ep.id)
        else:
            self.store.rewind(turn.ep, turn.undo)


def _check_same(ep: Episode, tools: list[dict[str, Any]] | None, spec: SamplingSpec) -> None:
    if ep.messages is None:
        raise BadRequest(f"episode {ep.id!r} is a text episode (opened over gRPC); use /v1/completions or Step")
    if (tools or None) != (ep.tools or None):
        raise BadRequest(
            "tools: an episode's tools are fixed by its first request (the template describes them "
            "once, before the first turn); send the same list"
        )
    _check_temperature(ep, spec)


def _check_temperature(ep: Episode, spec: SamplingSpec) -> None:
    if spec.temperature != ep.spec.temperature:
        raise BadRequest(
            f"temperature: {spec.temperature:g} differs from the episode's {ep.spec.temperature:g}; one trajectory "
            "is trained at one temperature"
        )


def _shared_prefix(a: list[tuple], b: list[tuple]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
