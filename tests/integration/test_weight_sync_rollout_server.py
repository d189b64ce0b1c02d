"""Weight sync into the real rollout server: ``python -m rollout_server`` with the transformers engine.

The other weight-sync tests load into the standalone receiver (tests/weight_receiver.py); this one goes
through what production runs: the server's Control servicer, its engine's pause gates, its registry
heartbeat (the sender finds it through ``buffer.ServerRegistry``, not an address list) and its GetStatus.
One server per module (a start costs seconds on two cores), so the tests run in file order and each
publishes the next version. What is checked is behaviour — versions, tokens, checksums — never time.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
import yaml

from buffer import RedisKeys, ServerRegistry
from rollout_server.launch import ServerProcess, spawn_server
from tether.client import RolloutClient
from tether.config import load_config
from tether.redis_server import free_port
from weight_sync.sender import WeightSender

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [60, 61, 62, 63, 64]  # byte-level tokenizer: ids are bytes
STREAM_TOKENS = 1500  # long enough that an update lands while the stream is still generating


@pytest.fixture(scope="module")
def run_id() -> str:
    return f"wsrs-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory, run_id: str, redis_server: str, tiny_model_dir: Path) -> Path:
    """One file for both sides, as in a deployment: the server reads model/run/rollout, the learner weight_sync."""
    tmp = tmp_path_factory.mktemp("ws-rollout")
    path = tmp / "tether.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "run": {"run_id": run_id, "output_dir": str(tmp / "runs")},
                "model": {"path": str(tiny_model_dir)},
                # The session's Redis (a module-wide server outlives the per-test redis_url fixture, which
                # flushes the database); the run id keeps this module's registry apart.
                "buffer": {"redis_url": redis_server},
                "rollout": {
                    "engine": {"type": "transformers", "device": "cpu"},
                    "prompt_workers": 0,
                    "max_tokens": STREAM_TOKENS,
                    "heartbeat_s": 0.5,
                },
                "weight_sync": {
                    "transport": {"type": "gloo", "master_port": 0},
                    "verify_checksums": True,
                    # No snapshot: a failed transfer must fail the test, not be rescued by the fallback.
                    "snapshot_every": 0,
                    "prepare_timeout_s": 60,
                    "transfer_timeout_s": 30,
                    "commit_timeout_s": 30,
                },
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def server(config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = spawn_server([], config=config, port=free_port(), log_path=tmp_path_factory.mktemp("log") / "server.log")
    yield proc
    assert proc.terminate() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[RolloutClient]:
    with RolloutClient(server.address, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="module")
def learner(tiny_model_dir: Path) -> torch.nn.Module:
    """The learner's copy of the weights: the server's starting model, modified before each publication."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def registry(server: ServerProcess, redis_server: str, run_id: str) -> Iterator[ServerRegistry]:
    client = redis.Redis.from_url(redis_server)
    reg = ServerRegistry(client, RedisKeys(run_id))
    deadline = time.monotonic() + 30
    while not any(info.address == server.address for info in reg.live()):  # first heartbeat
        assert time.monotonic() < deadline, f"server never registered:\n{server.log_tail()}"
        time.sleep(0.1)
    yield reg
    client.close()


def make_sender(config: Path, learner: torch.nn.Module, registry: ServerRegistry, **overrides: str) -> WeightSender:
    cfg = load_config(config, [f"--weight_sync.{k}={v}" for k, v in overrides.items()])
    return WeightSender(cfg, model=learner, registry=registry)


def greedy_local(model: torch.nn.Module, n: int) -> list[int]:
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False)
    return out[0, len(PROMPT) :].tolist()


def greedy_remote(client: RolloutClient, n: int = 16) -> list[int]:
    (sample,) = client.generate(token_ids=PROMPT, n=1, max_tokens=n, temperature=0.0).samples
    return list(sample.token_ids)


def test_published_version_is_served_with_the_new_weights(client, learner, config, registry) -> None:
    before = greedy_remote(client)
    assert client.status().policy_version == 0
    with torch.no_grad():
        for p in learner.parameters():
            p.mul_(1.5)  # tied embeddings are one Parameter: scaled once
    sender = make_sender(config, learner, registry)
    try:
        metrics = sender.publish(1)
    finally:
        sender.close()
    # reached counts only servers whose Commit checksums (float64 sum per tensor) match the learner's.
    assert metrics["weight_sync/reached"] == 1 and metrics["weight_sync/dropped"] == 0, sender.last_dropped
    assert set(sender.last_checksums) == {name for name, _ in learner.named_parameters()}
    assert client.status().policy_version == 1
    after = greedy_remote(client)
    assert after != before
    assert after == greedy_local(learner, len(after))


def stream_versions(client: RolloutClient, started: threading.Event, out: dict) -> None:
    tokens, versions = [], []
    for chunk in client.generate_stream(token_ids=PROMPT, n=1, max_tokens=STREAM_TOKENS, temperature=1.0, seed=7):
        tokens += chunk.token_ids
        versions += chunk.policy_versions
        started.set()
        if chunk.finish_reason:
            out["finish_reason"] = chunk.finish_reason
    out["tokens"], out["versions"] = tokens, versions
    started.set()


@pytest.mark.parametrize("inflight", ["keep", "drain"])
def test_update_during_a_stream(client, learner, config, registry, inflight: str) -> None:
    old = client.status().policy_version
    new = old + 1
    with torch.no_grad():
        learner.model.norm.weight.add_(0.25)
    sender = make_sender(config, learner, registry, inflight=inflight)
    started, out = threading.Event(), {}
    reader = threading.Thread(target=stream_versions, args=(client, started, out))
    reader.start()
    try:
        assert started.wait(60)
        metrics = sender.publish(new)  # the stream is generating: its first chunk has arrived
    finally:
        reader.join(120)
        sender.close()
    assert metrics["weight_sync/reached"] == 1, sender.last_dropped
    assert client.status().policy_version == new
    versions = out["versions"]
    assert len(versions) == len(out["tokens"]) > 0
    assert versions == sorted(versions) and set(versions) <= {old, new}
    if inflight == "drain":
        assert set(versions) == {old}  # Prepare waited for the stream to finish on the old weights
    else:
        # Frozen between two tokens, resumed on the new weights: the tail carries the new version.
        assert versions[0] == old and versions[-1] == new, f"{len(versions)} tokens, all {set(versions)}"
