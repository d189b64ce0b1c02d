"""The OpenAI-compatible door of a rollout server: FastAPI routes on the server's own event loop and engine.

    POST /v1/chat/completions    POST /v1/completions    GET /v1/models
    POST /v1/episodes/{id}/reward   (closes an episode with the agent's reward; gRPC CloseEpisode does the same)

A request with ``X-Tether-Episode: <name>`` (or ``metadata.tether_episode``) is a turn of that episode, recorded
token for token (:mod:`rollout_server.openai_api.sessions`); ``X-Tether-Group`` / ``X-Tether-Group-Size`` (or
``metadata.tether_group`` / ``tether_group_size``) make episodes one GRPO group. A request without one is served
and not recorded. Auth (the run's bearer token), admission (``rollout.max_concurrent_requests``: 429) and
draining (503) are the gRPC path's own; a request arriving during a weight update waits up to
``rollout.openai.pause_wait_s``, then gets 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from rollout_server.engines.base import Completion, EngineRejected, SamplingSpec
from rollout_server.episodes import EpisodeStore
from rollout_server.openai_api import responses as r
from rollout_server.openai_api.schemas import ChatCompletionRequest, CompletionRequest, RewardRequest
from rollout_server.openai_api.sessions import ChatSessions, Turn, reply_entry, template_message
from rollout_server.openai_api.tool_calls import parse_tool_calls, parser_for
from rollout_server.service import IncrementalText
from rollout_server.state import ServerState
from rollout_server.validation import BadRequest, check_length, check_vocab, sampling_spec
from tether.auth import auth_token
from tether.logs import get_logger
from tether.prompts import encode_prompt, render_chat
from tether.v1 import rollout_pb2

log = get_logger(__name__)

EPISODE_HEADER = "x-tether-episode"
GROUP_HEADER = "x-tether-group"
GROUP_SIZE_HEADER = "x-tether-group-size"


class HttpError(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


def served_model_name(state: ServerState) -> str:
    cfg = state.cfg
    return cfg.rollout.openai.served_model_name or cfg.run.run_id or Path(cfg.model.path).name or "tether"


class Door:
    """What the routes call: one server's engine, episode store and limits."""

    def __init__(self, state: ServerState, store: EpisodeStore) -> None:
        self.state = state
        self.store = store
        self.sessions = ChatSessions(store)
        self.model = served_model_name(state)
        self.reward: Any = None  # the run's reward, built at the first episode the server scores
        self.parser = parser_for(
            getattr(state.engine.tokenizer, "chat_template", None), state.cfg.rollout.openai.tool_call_parser
        )

    # -- shared steps ------------------------------------------------------------------------------------
    def spec(self, body: ChatCompletionRequest | CompletionRequest, *, episode: bool) -> SamplingSpec:
        p = rollout_pb2.SamplingParams(n=body.n, stop=list(body.stops()), max_tokens=body.token_limit() or 0)
        for name in ("temperature", "top_p", "seed"):
            if getattr(body, name) is not None:
                setattr(p, name, getattr(body, name))
        if episode and body.n != 1:
            raise HttpError(
                r.error(
                    400,
                    "n: an episode's turn has one sample (open one episode per sample, sharing X-Tether-Group)",
                    param="n",
                )
            )
        if episode and (body.top_p or 1.0) != 1.0:
            raise HttpError(
                r.error(
                    400,
                    "top_p: episodes are trained on, so they sample the full distribution the "
                    "learner recomputes; leave top_p unset or 1",
                    param="top_p",
                )
            )
        try:
            return sampling_spec(p, self.state.cfg.rollout)
        except BadRequest as e:
            field = str(e).split(":", 1)[0].removeprefix("sampling.")
            raise HttpError(r.error(400, str(e), param=field)) from None

    async def wait_unpaused(self) -> None:
        engine, limit = self.state.engine, self.state.cfg.rollout.openai.pause_wait_s
        if not engine.paused:
            return
        try:
            await asyncio.wait_for(engine.wait_resumed(), timeout=limit)
        except TimeoutError:
            raise HttpError(
                r.error(
                    503,
                    f"the engine is paused (a weight update) longer than {limit:g}s "
                    "(rollout.openai.pause_wait_s); retry",
                    headers={"Retry-After": "5"},
                )
            ) from None

    def episode_of(self, request: Request, body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any] | None:
        meta = dict(body.metadata or {})
        name = request.headers.get(EPISODE_HEADER) or meta.pop("tether_episode", "")
        if not name:
            return None
        if self.state.sink is None:
            raise HttpError(
                r.error(
                    409,
                    "episodes need the buffer: start the server with run.run_id and buffer.redis_url set",
                    param=EPISODE_HEADER,
                )
            )
        group = request.headers.get(GROUP_HEADER) or meta.pop("tether_group", "")
        size = request.headers.get(GROUP_SIZE_HEADER) or meta.pop("tether_group_size", "1")
        if not size.isdigit() or int(size) < 1:
            raise HttpError(r.error(400, f"group size: {size!r} is not a positive integer", param=GROUP_SIZE_HEADER))
        return {"name": name, "group_id": group, "group_size": int(size), "metadata": meta}

    async def score(self, episode_id: str, context: dict[str, str]) -> tuple[float, dict[str, float]]:
        """The run's reward (``rollout.reward``: a rule, a reward service, routing by source) on the episode's
        transcript: the prompt as text and everything after it — model turns and what the agent added — as the
        completion, with the agent's ``reward_context`` (e.g. ``{"answer": "42"}``)."""
        from rollout_server.rewards import RewardError, ScoreItem, build_reward

        ep = self.store.get(episode_id)
        if self.reward is None:
            self.reward = build_reward(self.state.cfg)
        tok = self.state.engine.tokenizer
        item = ScoreItem(
            prompt=tok.decode(ep.prompt_ids, skip_special_tokens=True),
            completion=tok.decode(ep.tokens, skip_special_tokens=True),
            prompt_token_ids=ep.prompt_ids,
            completion_token_ids=ep.tokens,
            reward_context=context,
            trajectory_id=episode_id,
        )
        try:
            ((reward, components),) = await self.reward.score([item])
        except RewardError as e:
            raise HttpError(
                r.error(
                    503,
                    f"the run's reward (rollout.reward) failed: {e}; the episode is still "
                    "open: retry, or send the reward yourself",
                    headers={"Retry-After": "1"},
                )
            ) from None
        return float(reward), dict(components)

    @contextlib.asynccontextmanager
    async def admitted(self, name: str | None) -> AsyncIterator[None]:
        """Admission, then the episode's lock (one turn at a time)."""
        await self.wait_unpaused()
        async with self.state.admit():
            lock = self.sessions.lock(name) if name else contextlib.nullcontext()
            async with lock:
                yield


class Guard:
    """Pure ASGI middleware (Starlette's ``BaseHTTPMiddleware`` costs a task group and two memory streams a
    request): the run's bearer token on every route but ``/health``; each answer counted by route and status
    (``tether_rollout_requests{method="http:/v1/chat/completions", code="429"}``) and timed."""

    def __init__(self, app: Any, *, state: ServerState, token: str) -> None:
        self.app, self.state = app, state
        self.expected = f"Bearer {token}".encode() if token else b""

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def send_counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        sent = dict(scope["headers"]).get(b"authorization", b"")
        if self.expected and scope["path"] != "/health" and not hmac.compare_digest(sent, self.expected):
            what = "missing 'Authorization: Bearer <token>'" if not sent else "wrong bearer token"
            response = r.error(
                401, f"{what} (the run's token: rollout.auth_token / TETHER_AUTH_TOKEN)", code="invalid_api_key"
            )
            await response(scope, receive, send_counted)
        else:
            await self.app(scope, receive, send_counted)
        route = f"http:{getattr(scope.get('route'), 'path', 'other')}"
        self.state.metrics.requests.labels(route, str(status[0])).inc()
        self.state.metrics.latency.labels(route).observe(time.perf_counter() - start)


def build_app(state: ServerState, store: EpisodeStore) -> FastAPI:
    """The ASGI app; :mod:`rollout_server.openai_api.serve` runs it on the server's loop."""
    app = FastAPI(title="tether rollout server (OpenAI-compatible)", docs_url=None, redoc_url=None, openapi_url=None)
    door = Door(state, store)
    token = auth_token(state.cfg.rollout.auth_token)
    app.state.door = door

    app.add_middleware(Guard, state=state, token=token)

    _add_error_handlers(app)

    @app.get("/health")
    async def _health() -> dict[str, str]:
        return {"status": "draining" if state.draining else "ok"}

    @app.get("/v1/models")
    async def _models() -> dict[str, Any]:
        card = {
            "id": door.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "tether",
            "root": state.cfg.model.path,
            "max_model_len": state.engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def _chat(body: ChatCompletionRequest, request: Request) -> Any:
        return await chat_completion(door, body, request)

    @app.post("/v1/completions")
    async def _completions(body: CompletionRequest, request: Request) -> Any:
        return await text_completion(door, body, request)

    @app.post("/v1/episodes/{episode_id}/reward")
    async def _reward(episode_id: str, body: RewardRequest) -> dict[str, Any]:
        async with door.sessions.lock(episode_id):
            reward, components = body.reward, dict(body.reward_components)
            if reward is None:  # scored here, by the run's reward, on the episode's transcript
                reward, scored = await door.score(episode_id, body.reward_context)
                components = {**scored, **components}
            close = rollout_pb2.CloseEpisodeRequest(
                episode_id=episode_id, reward=reward, reward_components=components, metadata=body.metadata
            )
            out = await store.close(close)
        return {
            "reward": reward,
            "episode_id": episode_id,
            "trajectory_id": out.trajectory_id,
            "group_id": out.group_id,
            "completion_tokens": out.num_completion_tokens,
            "group_written": out.group_written,
        }

    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Errors as OpenAI-style error bodies: a request that fails validation, a refusal of ours, a gRPC-path
    ``BadRequest`` (its status by code) and sampling settings the engine refuses."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return r.error(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)

    @app.exception_handler(HttpError)
    async def _http(_request: Request, exc: HttpError) -> JSONResponse:
        return exc.response

    @app.exception_handler(BadRequest)
    async def _bad(_request: Request, exc: BadRequest) -> JSONResponse:
        status = r.HTTP_STATUS.get(exc.code, 400)
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        return r.error(status, str(exc), headers=headers)

    @app.exception_handler(EngineRejected)
    async def _rejected(_request: Request, exc: EngineRejected) -> JSONResponse:
        return r.error(400, f"the engine refused the sampling settings: {exc}")


# -- chat ----------------------------------------------------------------------------------------------------
def _tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    return [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None


async def chat_completion(door: Door, body: ChatCompletionRequest, request: Request) -> Any:
    episode = door.episode_of(request, body)
    spec = door.spec(body, episode=episode is not None)
    tools = _tools(body)
    parser = door.parser if tools and body.tool_choice != "none" else "none"
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    stack = contextlib.AsyncExitStack()
    await stack.enter_async_context(door.admitted(episode["name"] if episode else None))
    try:
        if episode:
            turn = door.sessions.prepare(
                episode["name"],
                body.messages,
                tools,
                spec,
                group_id=episode["group_id"],
                group_size=episode["group_size"],
                metadata=episode["metadata"],
            )
            context, spec = turn.context, turn.spec
            _note_branch(door, turn)
        else:
            turn = None
            tok = door.state.engine.tokenizer
            text = render_chat(tok, [template_message(m) for m in body.messages], tools=tools)
            context = check_length(
                encode_prompt(tok, text), door.state.cfg.rollout, max_model_len=door.state.engine.max_model_len
            )
    except BaseException:
        await stack.aclose()
        raise
    if body.stream:
        gen = _chat_stream(door, body, rid, context, spec, turn, parser, stack)
        return StreamingResponse(gen, media_type="text/event-stream")
    async with stack:
        samples = await _generate(door, context, spec, rid, turn)
        choices = []
        for i, s in enumerate(samples):
            content, calls = _reply(door, s, spec, parser)
            if turn is not None:
                door.sessions.commit(turn, s, reply_entry(content, calls))
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            choice = {
                "index": i,
                "message": message,
                "finish_reason": r.finish_reason(s, calls),
                "logprobs": {"content": r.token_logprobs(door.state.engine.tokenizer, s)} if body.logprobs else None,
                "tether": r.extension(s),
            }
            choices.append(choice)
        return _whole("chat.completion", rid, door, choices, context, samples, turn)


def _whole(
    kind: str,
    rid: str,
    door: Door,
    choices: list[dict[str, Any]],
    context: list[int],
    samples: list[Completion],
    turn: Turn | None,
) -> JSONResponse:
    """A whole (not streamed) completion's body, returned as is (no ``jsonable_encoder`` pass over it)."""
    body = r.envelope(
        kind,
        rid,
        door.model,
        choices=choices,
        usage=r.usage(len(context), samples),
        tether=_turn_info(turn, len(context)),
    )
    return JSONResponse(body)


def _reply(door: Door, s: Completion, spec: SamplingSpec, parser: str) -> tuple[str | None, list[dict[str, Any]]]:
    text = r.cut_at_stop(s.text, spec.stop)
    parsed = parse_tool_calls(text, parser)  # type: ignore[arg-type]
    if parsed.malformed:
        door.state.metrics.tool_calls_malformed.inc()
    return parsed.content, parsed.calls


def _turn_info(turn: Turn | None, prompt_tokens: int) -> dict[str, Any]:
    if turn is None:
        return {"episode_id": None, "prompt_tokens": prompt_tokens}
    return {
        "episode_id": turn.ep.id,
        "turn": turn.ep.turns,
        "branched": turn.branched,
        "dropped_tokens": turn.dropped_tokens,
        "prompt_tokens": prompt_tokens,
    }


async def _generate(
    door: Door, context: list[int], spec: SamplingSpec, rid: str, turn: Turn | None
) -> list[Completion]:
    try:
        return await door.state.engine.generate(context, spec, request_id=rid)
    except BaseException:
        if turn is not None:
            door.sessions.abandon(turn)
        raise


def _note_branch(door: Door, turn: Turn | None) -> None:
    if turn is not None and turn.branched:
        door.state.metrics.episode_branches.inc()
        log.info("episode_branched", episode_id=turn.ep.id, dropped_tokens=turn.dropped_tokens)


async def _chat_stream(
    door: Door,
    body: ChatCompletionRequest,
    rid: str,
    context: list[int],
    spec: SamplingSpec,
    turn: Turn | None,
    parser: str,
    stack: contextlib.AsyncExitStack,
) -> AsyncIterator[str]:
    """SSE chunks as the engine samples; with tools the text is held back to the end, where it is parsed (a
    half-written ``<tool_call>`` must not reach the client as content)."""
    engine = door.state.engine
    samples = [Completion() for _ in range(spec.n)]
    texts = [IncrementalText(engine.tokenizer) for _ in range(spec.n)]
    holds = [r.StopHold(spec.stop) for _ in range(spec.n)]
    finished = False
    ends: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
    try:
        yield _first_chunk(door, rid, spec.n)
        agen = engine.stream(context, spec, request_id=rid)
        try:
            async for c in agen:
                samples[c.index].add(c)
                delta = holds[c.index].push(
                    texts[c.index].push(c.token_ids, final=bool(c.finish_reason)), final=bool(c.finish_reason)
                )
                piece = {"token_ids": c.token_ids, "logprobs": c.logprobs, "policy_versions": c.versions}
                if c.finish_reason:  # goes out with the sample's finish_reason, below
                    ends[c.index] = ({"content": delta} if delta else {}), piece
                elif parser == "none":
                    choice = {
                        "index": c.index,
                        "delta": {"content": delta} if delta else {},
                        "finish_reason": None,
                        "tether": piece,
                    }
                    yield r.sse(r.envelope("chat.completion.chunk", rid, door.model, choices=[choice]))
        finally:
            await agen.aclose()
        replies = _commit_replies(door, samples, spec, parser, turn)
        finished = True  # recorded: a client gone from here on changes nothing
        last = _last_chunks(door, rid, context, samples, replies, ends=ends, turn=turn, parser=parser,
                            usage=body.include_usage())  # fmt: skip
        for chunk in last:
            yield chunk
    finally:
        if not finished and turn is not None:
            door.sessions.abandon(turn)
        await stack.aclose()


def _first_chunk(door: Door, rid: str, n: int) -> str:
    """The stream's opening chunk: each choice's assistant role, no content yet."""
    head = {"role": "assistant", "content": ""}
    choices = [{"index": i, "delta": head, "finish_reason": None} for i in range(n)]
    return r.sse(r.envelope("chat.completion.chunk", rid, door.model, choices=choices))


def _commit_replies(
    door: Door, samples: list[Completion], spec: SamplingSpec, parser: str, turn: Turn | None
) -> list[tuple[str | None, list[dict[str, Any]]]]:
    """Each streamed sample's text and its reply (content, tool calls), recorded in the episode's turn if any."""
    replies = []
    for s in samples:
        s.text = door.state.engine.decode(s.token_ids)
        replies.append(_reply(door, s, spec, parser))
        if turn is not None:
            door.sessions.commit(turn, s, reply_entry(*replies[-1]))
    return replies


def _last_chunks(
    door: Door,
    rid: str,
    context: list[int],
    samples: list[Completion],
    replies: list[tuple[str | None, list[dict[str, Any]]]],
    *,
    ends: dict[int, tuple[dict[str, Any], dict[str, Any]]],
    turn: Turn | None,
    parser: str,
    usage: bool,
) -> list[str]:
    """The stream's closing chunks: each choice's finish (with the whole parsed reply when tools hold the text
    back), the usage when asked for, then ``[DONE]``."""
    chunks = []
    for i, (s, (content, calls)) in enumerate(zip(samples, replies, strict=True)):
        delta, piece = ends.get(i, ({}, r.extension(Completion())))
        if parser != "none":  # the whole reply, parsed, at the end
            delta, piece = ({"content": content} if content else {}), r.extension(s)
            if calls:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(calls)]
        last = {"index": i, "delta": delta, "finish_reason": r.finish_reason(s, calls), "tether": piece}
        chunks.append(
            r.sse(
                r.envelope(
                    "chat.completion.chunk", rid, door.model, choices=[last], tether=_turn_info(turn, len(context))
                )
            )
        )
    if usage:
        chunks.append(
            r.sse(
                r.envelope("chat.completion.chunk", rid, door.model, choices=[], usage=r.usage(len(context), samples))
            )
        )
    chunks.append(r.sse("[DONE]"))
    return chunks


# -- text completions ----------------------------------------------------------------------------------------
async def text_completion(door: Door, body: CompletionRequest, request: Request) -> Any:
    episode = door.episode_of(request, body)
    spec = door.spec(body, episode=episode is not None)
    if body.stream:
        raise HttpError(
            r.error(400, "stream: not supported on /v1/completions; use /v1/chat/completions", param="stream")
        )
    rid = f"cmpl-{uuid.uuid4().hex}"
    s = door.state
    async with door.admitted(episode["name"] if episode else None):
        if episode:
            if not isinstance(body.prompt, str):
                raise HttpError(r.error(400, "prompt: an episode's prompt is text", param="prompt"))
            turn = door.sessions.prepare_text(
                episode["name"],
                body.prompt,
                spec,
                group_id=episode["group_id"],
                group_size=episode["group_size"],
                metadata=episode["metadata"],
            )
            context, spec = turn.context, turn.spec
        else:
            turn = None
            ids = (
                encode_prompt(s.engine.tokenizer, body.prompt)
                if isinstance(body.prompt, str)
                else check_vocab(list(body.prompt), vocab_size=s.vocab_size())
            )
            context = check_length(ids, s.cfg.rollout, max_model_len=s.engine.max_model_len)
        _note_branch(door, turn)
        samples = await _generate(door, context, spec, rid, turn)
        choices = []
        for i, x in enumerate(samples):
            text = r.cut_at_stop(x.text, spec.stop)
            if turn is not None:
                door.sessions.commit(turn, x, text)
            logprobs = None
            if body.logprobs is not None:
                tokens = r.token_texts(s.engine.tokenizer, x.token_ids)
                logprobs = {"tokens": tokens, "token_logprobs": x.logprobs, "top_logprobs": None, "text_offset": None}
            choices.append(
                {
                    "index": i,
                    "text": text,
                    "finish_reason": r.finish_reason(x, []),
                    "logprobs": logprobs,
                    "tether": r.extension(x),
                }
            )
    return _whole("text_completion", rid, door, choices, context, samples, turn)
