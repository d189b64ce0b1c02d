"""The rollout server as a separate process: Generate / GenerateStream, bad input, episodes, reflection.

One server per module (a start costs seconds on two cores); it gets a Redis and a run id so episodes
write real trajectories. Log-probs are checked against a forward pass of the same tiny model.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import grpc
import pytest
import torch

from rollout_server.launch import ServerProcess, spawn_server
from tests.helpers import read_groups
from tether.client import RolloutClient
from tether.config import load_config
from tether.redis_server import free_port
from tether.v1 import trajectory_pb2

pytestmark = pytest.mark.slow

MAX_MESSAGE = 256 * 1024


@pytest.fixture(scope="module")
def run_id() -> str:
    return f"rs-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, redis_server: str, run_id: str, tmp_path_factory) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("rollout")
    proc = spawn_server(
        [
            "--model.path",
            str(tiny_model_dir),
            "--run.run_id",
            run_id,
            "--run.output_dir",
            str(tmp / "runs"),
            "--buffer.redis_url",
            redis_server,
            "--rollout.prompt_workers",
            "0",
            "--rollout.max_tokens",
            "32",
            "--rollout.max_prompt_len",
            "200",
            "--rollout.max_n",
            "8",
            "--rollout.max_message_bytes",
            str(MAX_MESSAGE),
            "--rollout.episode_idle_timeout_s",
            "2",
            "--rollout.pause_timeout_s",
            "4",
        ],
        port=free_port(),
        log_path=tmp / "server.log",
    )
    yield proc
    assert proc.terminate() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with RolloutClient(server.address, timeout_s=60, max_message_bytes=8 * MAX_MESSAGE) as c:
        yield c


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_generate_returns_tokens_and_logprobs_of_the_model(client: RolloutClient, model) -> None:
    out = client.generate(text="digits:", n=3, max_tokens=16, temperature=1.0)
    assert out.logprob_source == "processed" and len(out.samples) == 3 and out.prompt_token_ids
    for s in out.samples:
        assert 0 < len(s.token_ids) == len(s.logprobs) == len(s.policy_versions) <= 16
        assert set(s.policy_versions) == {0}
        assert s.finish_reason in (trajectory_pb2.FINISH_REASON_STOP, trajectory_pb2.FINISH_REASON_LENGTH)
        ref = forward_logprobs(model, list(out.prompt_token_ids), list(s.token_ids))
        torch.testing.assert_close(torch.tensor(list(s.logprobs)), ref, atol=1e-4, rtol=1e-4)


def test_generate_stream_chunks_add_up(client: RolloutClient, model) -> None:
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logps: dict[int, list[float]] = {0: [], 1: []}
    finished, prompt = {}, None
    for i, c in enumerate(client.generate_stream(messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=10)):
        if i == 0:
            prompt = list(c.prompt_token_ids)
        else:
            assert not c.prompt_token_ids
        tokens[c.sample_index] += c.token_ids
        logps[c.sample_index] += c.logprobs
        if c.finish_reason:
            finished[c.sample_index] = c.finish_reason
    assert prompt and set(finished) == {0, 1}
    for k in (0, 1):
        ref = forward_logprobs(model, prompt, tokens[k])
        torch.testing.assert_close(torch.tensor(logps[k]), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "code", "words"),
    [
        ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt.text: empty"),
        ({"text": "x" * 300}, grpc.StatusCode.INVALID_ARGUMENT, "longer than the limit"),
        ({"token_ids": [1, 10**6]}, grpc.StatusCode.INVALID_ARGUMENT, "outside the vocabulary"),
        ({"text": "a", "n": 9}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.n"),
        ({"text": "a", "temperature": -0.5}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
        ({"text": "a", "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
        ({"text": "a", "top_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"),
        ({"text": "a", "max_tokens": 33}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens"),
        ({"messages": [{"role": "robot", "content": "x"}]}, grpc.StatusCode.INVALID_ARGUMENT, "role"),
        ({"text": "x" * (MAX_MESSAGE + 10)}, grpc.StatusCode.RESOURCE_EXHAUSTED, "larger than max"),
    ],
)
def test_bad_input_is_refused_and_the_server_keeps_serving(client: RolloutClient, kwargs, code, words) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(**kwargs)
    assert err.value.code() == code
    assert words in err.value.details()
    assert len(client.generate(text="ok", n=1, max_tokens=2).samples[0].token_ids) >= 1


def test_n_zero_means_the_server_default(client: RolloutClient) -> None:
    assert len(client.generate(text="a", n=0, max_tokens=1).samples) == load_config(None, []).rollout.n


def test_unknown_and_expired_episodes_are_not_found(client: RolloutClient) -> None:
    import time

    with pytest.raises(grpc.RpcError) as err:
        client.step("no-such-episode")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "not found" in err.value.details()
    ep = client.open_episode(text="q", max_tokens=2)
    time.sleep(2.5)
    with pytest.raises(grpc.RpcError) as err:
        client.step(ep.episode_id)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        client.close_episode(ep.episode_id, reward=0.0)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert client.status().server_id


def test_text_episode_lands_as_one_trajectory_with_the_right_mask(client, redis_server, run_id) -> None:
    ep = client.open_episode(text="start:", max_tokens=6, metadata={"env": "test"})
    turns = [client.step(ep.episode_id)]
    observations = ["obs one", "obs two!"]
    for obs in observations:
        turns.append(client.step(ep.episode_id, obs))
    closed = client.close_episode(ep.episode_id, reward=0.5, components={"win": 1.0})
    assert closed.group_written
    (group,) = read_groups(redis_server, run_id, 1)
    (t,) = group.trajectories
    assert list(t.prompt_token_ids) == list(ep.prompt_token_ids)
    expected_ids, expected_mask, expected_lp = [], [], []
    for i, turn in enumerate(turns):
        if i:
            obs_ids = list(observations[i - 1].encode())  # byte-level tokenizer: one token per byte
            expected_ids += obs_ids
            expected_mask += [0] * len(obs_ids)
            expected_lp += [0.0] * len(obs_ids)
        expected_ids += list(turn.token_ids)
        expected_mask += [1] * len(turn.token_ids)
        expected_lp += list(turn.logprobs)
    assert t.completion_token_ids.tolist() == expected_ids
    assert t.loss_mask.tolist() == expected_mask
    torch.testing.assert_close(torch.tensor(t.behavior_logprobs.tolist()), torch.tensor(expected_lp))
    assert t.reward == 0.5 and t.reward_components == {"win": 1.0} and t.metadata["env"] == "test"
    assert t.finish_reason == trajectory_pb2.FINISH_REASON_ENV_CLOSED
    assert turns[-1].total_tokens == len(ep.prompt_token_ids) + len(expected_ids)


def test_chat_episodes_form_one_group(client, redis_server, run_id, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    episodes = [
        client.open_episode(messages=[{"role": "user", "content": "hi"}], group_id="g1", group_size=2, max_tokens=5)
        for _ in range(2)
    ]
    written = []
    for ep in episodes:
        first = client.step(ep.episode_id)
        client.step(ep.episode_id, "the tool says 3", role="tool")
        written.append(client.close_episode(ep.episode_id, reward=1.0).group_written)
    assert written == [False, True]
    (group,) = read_groups(redis_server, run_id, 1)
    assert group.group_id == "g1" and len(group.trajectories) == 2
    t = group.trajectories[1]
    env = [tok_id for tok_id, m in zip(t.completion_token_ids.tolist(), t.loss_mask.tolist(), strict=True) if m == 0]
    text = tok.decode(env)
    assert text.endswith("<|im_start|>tool\nthe tool says 3<|im_end|>\n<|im_start|>assistant\n")
    assert t.loss_mask.tolist()[: len(first.token_ids)] == [1] * len(first.token_ids)


def test_reflection_lists_the_services(server: ServerProcess) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.address) as channel:
        names = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"tether.v1.Rollout", "tether.v1.Control", "grpc.health.v1.Health"} <= names


def test_status_and_control(client: RolloutClient) -> None:
    assert client.pause("drain").policy_version == 0
    assert client.status().paused
    client.resume()
    st = client.status()
    assert not st.paused and st.engine == "transformers" and st.generated_tokens > 0


def test_a_pause_nobody_resumes_ends_by_itself(client: RolloutClient, server: ServerProcess) -> None:
    """A client that paused the server and died: after rollout.pause_timeout_s (4 s here) the server resumes by
    itself, says so in its log, and generates again; a Resume in time stops that clock (the test above)."""
    client.pause("keep")
    assert client.status().paused
    deadline = time.monotonic() + 60
    while client.status().paused and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not client.status().paused
    assert "pause_expired" in server.log_path.read_text()
    out = client.generate(text="digits:", n=1, max_tokens=4)
    assert len(out.samples) == 1 and out.samples[0].token_ids
