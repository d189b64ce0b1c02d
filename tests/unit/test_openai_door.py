"""The OpenAI door's parts that need no model: the tool-call parsers, and an agent written for the OpenAI Agents
SDK driving the app in process against a scripted engine (a stand-in inside this unit test: its replies are a
tool call and then an answer, which a random tiny model would never write). Checked: the SDK runs the tool with
the arguments the model wrote, the final answer arrives, and the episode's trained record is exactly the scripted
ids with the template's tool turn between them; a call that does not parse comes back as text and is counted.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx2
import pytest

from rollout_server.openai_api.tool_calls import parse_tool_calls, parser_for
from tests.helpers import scripted_engine
from tether.commands.tiny_model import CHAT_TEMPLATE, build_tokenizer
from tether.prompts import encode_continuation

ADD_CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


# -- parsers -------------------------------------------------------------------------------------------------
def test_hermes_reads_calls_and_keeps_the_text_around_them() -> None:
    p = parse_tool_calls(f"Let me add.\n{ADD_CALL}\n<tool_call>{{\"name\": \"neg\", \"arguments\": {{}}}}</tool_call>",
                         "hermes")  # fmt: skip
    assert p.content == "Let me add." and not p.malformed
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in p.calls] == [
        ("add", {"a": 2, "b": 3}), ("neg", {})]  # fmt: skip
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in p.calls)
    assert parse_tool_calls("no call here", "hermes").calls == []


@pytest.mark.parametrize(
    "text",
    ['<tool_call>{"name": "add", "arguments": {"a": 2', '<tool_call>{"arguments": {}}</tool_call>',
     '<tool_call>not json</tool_call>', f'{ADD_CALL}<tool_call>{{"name": "x"'],
)  # fmt: skip
def test_hermes_refuses_a_call_it_cannot_read_whole(text: str) -> None:
    p = parse_tool_calls(text, "hermes")
    assert p.malformed and p.calls == [] and p.content == text


def test_llama3_json_reads_one_or_several_objects() -> None:
    one = parse_tool_calls('<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "llama3_json")
    assert [c["function"]["name"] for c in one.calls] == ["add"] and one.content is None
    two = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "arguments": "{\\"x\\": 1}"}', "llama3_json")
    assert [json.loads(c["function"]["arguments"]) for c in two.calls] == [{}, {"x": 1}]
    assert parse_tool_calls("The answer is 4.", "llama3_json").calls == []
    bad = parse_tool_calls('{"name": "add", "parameters": {"a": ', "llama3_json")
    assert bad.malformed and bad.content.startswith("{")


def test_auto_picks_the_parser_from_the_chat_template() -> None:
    assert parser_for(CHAT_TEMPLATE, "auto") == "hermes"
    assert parser_for("{{ '<|python_tag|>' }}", "auto") == "llama3_json"
    assert parser_for("{{ message['content'] }}", "auto") == "none"
    assert parser_for(CHAT_TEMPLATE, "none") == "none"


# -- an Agents SDK agent against the app ---------------------------------------------------------------------
def replies_of(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Each reply's ids, ending on ``<|im_end|>`` as the tiny model's turns do."""
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return [[*encode_continuation(tokenizer, t), end] for t in texts]


def _door(replies: list[str], redis_url: str):  # type: ignore[no-untyped-def]
    from rollout_server.episodes import EpisodeStore
    from rollout_server.metrics import ServerMetrics
    from rollout_server.openai_api.app import build_app
    from rollout_server.sink import BufferSink
    from rollout_server.state import ServerState
    from tether.config import TetherConfig

    tok = build_tokenizer()
    engine = scripted_engine(tok, replies_of(tok, replies), logprob=-0.25, version=7)
    cfg = TetherConfig.model_validate({"run": {"run_id": "door-unit"}, "buffer": {"redis_url": redis_url}})
    state = ServerState(cfg=cfg, engine=engine, server_id="s", metrics=ServerMetrics("s"), sink=BufferSink(cfg, "s"))
    store = EpisodeStore(state)
    return build_app(state, store), engine, state, store


def _client(app, episode: str):  # type: ignore[no-untyped-def]
    import openai

    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://door")
    headers = {"X-Tether-Episode": episode} if episode else {}
    return openai.AsyncOpenAI(base_url="http://door/v1", api_key="-", http_client=http, max_retries=0,
                              default_headers=headers)  # fmt: skip


async def test_an_agents_sdk_agent_calls_a_tool_and_trains_token_exact(redis_url: str) -> None:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    app, engine, state, store = _door([ADD_CALL, "The answer is 5."], redis_url)
    calls: list[tuple[int, int]] = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    client = _client(app, "agent-1")
    agent = Agent(name="calc", instructions="Use the tools.", tools=[add],
                  model=OpenAIChatCompletionsModel(model="tiny", openai_client=client))  # fmt: skip
    result = await Runner.run(agent, "What is 2 + 3?")
    assert calls == [(2, 3)] and result.final_output == "The answer is 5."
    ep = store.lookup("agent-1")
    assert ep is not None and ep.turns == 2
    first, second = engine.replies
    tok = engine.tokenizer
    # The record: reply one as sampled, the template's tool turn (its bytes: the byte-level tokenizer), reply two.
    assert ep.tokens[: len(first)] == first and ep.tokens[-len(second) :] == second
    between = tok.decode(ep.tokens[len(first) : -len(second)])
    assert between.startswith("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    assert ep.mask == [1] * len(first) + [0] * (len(ep.tokens) - len(first) - len(second)) + [1] * len(second)
    assert engine.seen[1] == ep.prompt_ids + ep.tokens[: -len(second)]  # the model saw exactly the record
    closed = await client.post("/episodes/agent-1/reward", body={"reward": 1.0}, cast_to=object)
    assert closed["group_written"] and closed["completion_tokens"] == len(ep.tokens)
    await client.close()
    await asyncio.to_thread(state.sink.close)


async def test_a_malformed_call_comes_back_as_text_and_is_counted(redis_url: str) -> None:
    app, _engine, state, _store = _door(['<tool_call>{"name": "add", "arguments": {"a": </tool_call>'], redis_url)
    client = _client(app, "agent-2")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3?"}], tools=tools)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content.startswith("<tool_call>")
    assert state.metrics.tool_calls_malformed._value.get() == 1
    await client.close()
    await asyncio.to_thread(state.sink.close)


def held_engine():  # type: ignore[no-untyped-def]
    """A scripted engine whose generations wait until its ``release`` event is set."""
    tok = build_tokenizer()
    engine = scripted_engine(tok, replies_of(tok, ["ok"]))
    engine.release = asyncio.Event()
    scripted = type(engine).stream

    async def stream(self, prompt_ids, spec, *, request_id):  # type: ignore[no-untyped-def]
        await self.release.wait()
        async for c in scripted(self, prompt_ids, spec, request_id=request_id):
            yield c

    type(engine).stream = stream
    return engine


async def test_over_capacity_is_429_and_a_long_pause_is_503(redis_url: str) -> None:
    import openai

    from rollout_server.episodes import EpisodeStore
    from rollout_server.metrics import ServerMetrics
    from rollout_server.openai_api.app import build_app
    from rollout_server.state import ServerState
    from tether.config import TetherConfig

    engine = held_engine()
    cfg = TetherConfig.model_validate({"rollout": {"max_concurrent_requests": 1, "openai": {"pause_wait_s": 0.2}}})
    state = ServerState(cfg=cfg, engine=engine, server_id="s", metrics=ServerMetrics("s"))
    client = _client(build_app(state, EpisodeStore(state)), "")
    messages = [{"role": "user", "content": "hi"}]
    first = asyncio.create_task(client.chat.completions.create(model="m", messages=messages, max_tokens=4))
    while state.inflight == 0:
        await asyncio.sleep(0.01)
    with pytest.raises(openai.RateLimitError) as err:
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    assert "rollout.max_concurrent_requests" in err.value.body["message"]
    assert state.metrics.requests.labels("http:/v1/chat/completions", "429")._value.get() == 1
    engine.release.set()
    assert (await first).choices[0].message.content == "ok"
    engine.is_paused = True
    with pytest.raises(openai.InternalServerError) as err:
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    assert err.value.status_code == 503 and "rollout.openai.pause_wait_s" in err.value.body["message"]
    assert err.value.response.headers["retry-after"]
    await client.close()


async def test_an_episode_nobody_closes_is_dead_lettered_with_its_reason(redis_url: str) -> None:
    import redis

    from buffer import RedisKeys
    from rollout_server.episodes import EXPIRED

    app, _engine, state, store = _door(["fine"], redis_url)
    state.cfg.rollout.episode_idle_timeout_s = 0.2
    store.timeout_s = 0.2
    client = _client(app, "left-open")
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    sweeper = asyncio.create_task(store.sweep_forever())
    r = redis.Redis.from_url(redis_url)
    keys = RedisKeys("door-unit")
    before = int(r.hget(keys.counters, "rollout_dead_letter") or 0)
    for _ in range(100):
        if len(store) == 0 and r.hget(keys.counters, EXPIRED):  # (a lookup would count as a use of it)
            break
        await asyncio.sleep(0.05)
    sweeper.cancel()
    (entry,) = [f for _, f in r.xrange(keys.dead_letter) if b"left-open" in f[b"reason"]]
    assert b"not closed within 0.2s (rollout.episode_idle_timeout_s)" in entry[b"reason"]
    assert json.loads(entry[b"data"])["turns"] == 1
    assert int(r.hget(keys.counters, EXPIRED)) == 1
    assert int(r.hget(keys.counters, "rollout_dead_letter") or 0) == before  # no prompt slot given back for it
    r.close()
    await client.close()
    await asyncio.to_thread(state.sink.close)


async def test_an_episode_closed_without_a_reward_is_scored_by_the_run_s_reward(redis_url: str) -> None:
    """rollout.reward (here the demo's charclass rule) scores the transcript after the prompt, with the agent's
    reward_context; the trajectory carries that reward."""
    from tests.helpers import read_groups

    app, _engine, state, _store = _door(["123ab"], redis_url)  # 3 of the 5 characters are digits
    client = _client(app, "scored")
    await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "digits:"}])
    out = await client.post("/episodes/scored/reward", body={"reward_context": {"answer": "digits"}}, cast_to=object)
    assert out["reward"] == pytest.approx(3 / 5) and out["group_written"]
    (group,) = await asyncio.to_thread(read_groups, redis_url, "door-unit", 1)
    assert group.trajectories[0].reward == pytest.approx(3 / 5)
    import openai

    with pytest.raises(openai.NotFoundError):  # closed: there is nothing left to score
        await client.post("/episodes/scored/reward", body={}, cast_to=object)
    await client.close()
    await asyncio.to_thread(state.sink.close)


def test_a_streamed_reply_stops_at_a_stop_string_split_across_pieces() -> None:
    from rollout_server.openai_api.responses import StopHold

    hold = StopHold(("END",))
    pieces = ["hello E", "N", "D tail", " more"]
    sent = [hold.push(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert "".join(sent) == "hello " and sent[0] == "hello "  # "E" held until "ND" said it was the stop
    plain = StopHold(("END",))
    assert "".join(plain.push(p, final=f) for p, f in [("an E", False), ("xit", True)]) == "an Exit"
    assert StopHold(()).push("abc", final=False) == "abc"
