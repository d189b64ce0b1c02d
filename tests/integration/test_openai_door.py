"""The OpenAI-compatible door of a real rollout server process (tiny model, transformers engine, real Redis),
driven by the ``openai`` client — sync, async and streaming. A multi-turn episode's trained record is compared
id for id with what the responses said was sampled and what the template adds between turns (nothing is decoded
to check it); a retried or edited turn branches; the reward closes the episode into a group the learner reads;
bad input, a wrong token and overload come back in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import openai
import pytest

from rollout_server.launch import ServerProcess, spawn_server
from tests.helpers import read_groups
from tether.prompts import encode_chat
from tether.redis_server import free_port

pytestmark = pytest.mark.slow

TOKEN = "door-token"


@pytest.fixture(scope="module")
def run_id() -> str:
    return f"door-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def http_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, redis_server: str, run_id: str, http_port: int, tmp_path_factory) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("door")
    args = ["--model.path", str(tiny_model_dir), "--run.run_id", run_id, "--run.output_dir", str(tmp / "runs"),
            "--buffer.redis_url", redis_server, "--rollout.prompt_workers", "0", "--rollout.max_tokens", "24",
            "--rollout.max_prompt_len", "600", "--rollout.auth_token", TOKEN,
            "--rollout.openai.port", str(http_port)]  # fmt: skip
    proc = spawn_server(args, port=free_port(), log_path=tmp / "server.log")
    yield proc
    assert proc.terminate() == 0


@pytest.fixture(scope="module")
def base_url(server: ServerProcess, http_port: int) -> str:
    return f"http://127.0.0.1:{http_port}/v1"


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def ext(obj) -> dict:
    return obj.model_extra["tether"]


def test_models_lists_the_served_model(client: openai.OpenAI, run_id: str) -> None:
    (card,) = client.models.list().data
    assert card.id == run_id


def test_a_plain_request_is_served_with_the_sampled_ids(client: openai.OpenAI, tok) -> None:
    messages = [{"role": "user", "content": "Say hi."}]
    out = client.chat.completions.create(model="any", messages=messages, max_tokens=8, logprobs=True, n=2, seed=3)
    assert len(out.choices) == 2
    for choice in out.choices:
        ids = ext(choice)["token_ids"]
        assert 0 < len(ids) <= 8
        assert [c.logprob for c in choice.logprobs.content] == ext(choice)["logprobs"]
        assert ext(choice)["policy_versions"] == [0] * len(ids)
    assert out.usage.prompt_tokens == len(encode_chat(tok, messages))
    assert out.usage.completion_tokens == sum(len(ext(c)["token_ids"]) for c in out.choices)
    assert ext(out)["episode_id"] is None


def _turn(client: openai.OpenAI, episode: str, messages: list[dict], **kw):
    return client.chat.completions.create(
        model="m", messages=messages, max_tokens=6, extra_headers={"X-Tether-Episode": episode}, **kw
    )


def test_a_multi_turn_episode_trains_on_exactly_the_sampled_ids(client, tok, redis_server, run_id) -> None:
    """Three turns, each sending back the whole transcript as an agent does; the trained record is the first
    prompt's ids, then per turn the sampled ids and, between turns, the template's ids for the new messages."""
    eid = f"ep-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: 1, 2,"}]
    expected_prompt = encode_chat(tok, messages)
    expected, mask, sampled = [], [], []
    for i, new in enumerate([None, "and then?", "last one"]):
        if new is not None:
            messages.append({"role": "user", "content": new})
            # What ChatML writes after the model's turn and for the new message (byte-level tokenizer).
            env = (("" if sampled[-1][-1:] == [tok.convert_tokens_to_ids("<|im_end|>")] else "<|im_end|>")
                   + f"\n<|im_start|>user\n{new}<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
            env_ids = tok(env, add_special_tokens=False)["input_ids"]
            expected += env_ids
            mask += [0] * len(env_ids)
        out = _turn(client, eid, messages)
        ids = ext(out.choices[0])["token_ids"]
        assert ext(out)["episode_id"] == eid and ext(out)["turn"] == i + 1 and not ext(out)["branched"]
        sampled.append(ids)
        expected += ids
        mask += [1] * len(ids)
        messages.append(out.choices[0].message.model_dump(exclude_none=True))  # what the openai client returns
    closed = client.post(f"/episodes/{eid}/reward", body={"reward": 0.75}, cast_to=object)
    assert closed["group_written"] and closed["completion_tokens"] == len(expected)
    (group,) = [g for g in read_groups(redis_server, run_id, 1) if eid in g.group_id]
    (t,) = group.trajectories
    assert t.prompt_token_ids.tolist() == expected_prompt
    assert t.completion_token_ids.tolist() == expected
    assert t.loss_mask.tolist() == mask
    assert t.reward == 0.75 and t.metadata["turns"] == "3"


def test_a_retried_turn_branches_from_the_shared_prefix(client, tok) -> None:
    eid = f"ep-{uuid.uuid4().hex[:6]}"
    messages = [{"role": "user", "content": "a"}]
    first = _turn(client, eid, messages)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "b"})
    second = _turn(client, eid, messages)
    assert not ext(second)["branched"]
    retry = _turn(client, eid, messages)  # the same request again: its reply was "lost"
    assert ext(retry)["branched"] and ext(retry)["turn"] == 2
    assert ext(retry)["dropped_tokens"] > len(ext(second.choices[0])["token_ids"])  # the reply and what led to it
    edited = [{"role": "user", "content": "a, edited"}]
    fresh = _turn(client, eid, edited)
    assert ext(fresh)["branched"] and ext(fresh)["turn"] == 1
    assert fresh.usage.prompt_tokens == len(encode_chat(tok, edited))


def test_streaming_sends_the_same_record_as_the_chunks(client, redis_server, run_id) -> None:
    eid = f"ep-{uuid.uuid4().hex[:6]}"
    stream = _turn(client, eid, [{"role": "user", "content": "stream"}], stream=True,
                   stream_options={"include_usage": True})  # fmt: skip
    ids, text, usage, finish = [], "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids += c.model_extra.get("tether", {}).get("token_ids", [])
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert ids and finish in ("stop", "length") and usage.completion_tokens == len(ids)
    closed = client.post(f"/episodes/{eid}/reward", body={"reward": 1.0}, cast_to=object)
    assert closed["completion_tokens"] == len(ids)
    (group,) = [g for g in read_groups(redis_server, run_id, 1) if eid in g.group_id]
    assert group.trajectories[0].completion_token_ids.tolist() == ids


def test_the_async_client_and_a_group_of_episodes(base_url, redis_server, run_id) -> None:
    group = f"g-{uuid.uuid4().hex[:6]}"

    async def one(k: int) -> bool:
        c = openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN, max_retries=0, timeout=120)
        headers = {"X-Tether-Episode": f"{group}-{k}", "X-Tether-Group": group, "X-Tether-Group-Size": "3"}
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], max_tokens=4,
                                        extra_headers=headers)  # fmt: skip
        out = await c.post(f"/episodes/{group}-{k}/reward", body={"reward": float(k)}, cast_to=object)
        await c.close()
        return out["group_written"]

    async def all_of_them() -> list[bool]:
        return list(await asyncio.gather(*(one(k) for k in range(3))))

    assert sorted(asyncio.run(all_of_them())) == [False, False, True]
    (g,) = [g for g in read_groups(redis_server, run_id, 1) if g.group_id == group]
    assert sorted(t.reward for t in g.trajectories) == [0.0, 1.0, 2.0]


def test_errors_come_back_in_openai_shape(client, base_url) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}])
    assert err.value.body["param"] == "messages.0.role"
    with pytest.raises(openai.BadRequestError) as err:
        _turn(client, "ep-n", [{"role": "user", "content": "x"}], n=2)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=10_000)
    assert err.value.body["param"] == "max_tokens" and "rollout.max_tokens" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.post("/episodes/never-opened/reward", body={"reward": 1.0}, cast_to=object)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
