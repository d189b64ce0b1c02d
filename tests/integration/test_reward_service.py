"""examples/reward_service.py as a real process on a free port, called through the generated stubs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether.healthcheck import check
from tether.healthcheck import main as healthcheck_main
from tether.redis_server import free_port
from tether.v1 import reward_pb2, reward_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"


def _start(*extra: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "TETHER_AUTH_TOKEN"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "examples" / "reward_service.py"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"reward service exited {proc.returncode}: {proc.stdout.read().decode()}")
        if check(address, timeout_s=0.5)[0]:
            return proc, address
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("reward service did not report SERVING within 30 s")


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.fixture(scope="module")
def open_service() -> Iterator[str]:
    proc, address = _start()
    yield address
    assert _stop(proc) == 0


@pytest.fixture(scope="module")
def token_service() -> Iterator[str]:
    proc, address = _start("--token", TOKEN)
    yield address
    _stop(proc)


def _stub(address: str) -> tuple[grpc.Channel, reward_pb2_grpc.RewardStub]:
    channel = grpc.insecure_channel(address)
    return channel, reward_pb2_grpc.RewardStub(channel)


def _req(completion: str, answer: str | None = "42") -> reward_pb2.ScoreRequest:
    ctx = {} if answer is None else {"answer": answer}
    return reward_pb2.ScoreRequest(prompt="What is 6*7?", completion=completion, reward_context=ctx)


def test_score_boxed_and_last_number(open_service: str) -> None:
    channel, stub = _stub(open_service)
    with channel:
        right = stub.Score(_req("6*7 = \\boxed{42}"), timeout=5)
        assert right.reward == 1.0
        assert dict(right.components) == {"correct": 1.0, "boxed": 1.0}
        assert stub.Score(_req("I think it is 41, no wait, 42."), timeout=5).reward == 1.0
        # the boxed answer wins over a later number
        assert stub.Score(_req("\\boxed{41} because 42"), timeout=5).reward == 0.0
        assert stub.Score(_req("the total is 1,000", answer="1000"), timeout=5).reward == 1.0
        assert stub.Score(_req("\\boxed{\\frac{1}{2}}", answer="0.5"), timeout=5).reward == 1.0
        assert stub.Score(_req("no idea"), timeout=5).reward == 0.0


def test_score_batch_keeps_order(open_service: str) -> None:
    channel, stub = _stub(open_service)
    completions = ["\\boxed{42}", "7", "it is 42", "\\boxed{-3}"]
    with channel:
        reply = stub.ScoreBatch(reward_pb2.ScoreBatchRequest(requests=[_req(c) for c in completions]), timeout=5)
        assert [r.reward for r in reply.responses] == [1.0, 0.0, 1.0, 0.0]
        assert len(stub.ScoreBatch(reward_pb2.ScoreBatchRequest(), timeout=5).responses) == 0


def test_bad_input_is_invalid_argument_and_server_keeps_serving(open_service: str) -> None:
    channel, stub = _stub(open_service)
    with channel:
        with pytest.raises(grpc.RpcError) as err:
            stub.Score(_req("\\boxed{42}", answer=None), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "answer" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.ScoreBatch(reward_pb2.ScoreBatchRequest(requests=[_req("42"), _req("42", answer=None)]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.Score(_req("\\boxed{42}"), timeout=5).reward == 1.0
    assert check(open_service)[0]


def test_health_reports_serving(open_service: str) -> None:
    channel = grpc.insecure_channel(open_service)
    with channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tether.v1.Reward"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert healthcheck_main([open_service, "--quiet"]) == 0


def test_healthcheck_fails_fast_on_nothing_listening() -> None:
    start = time.monotonic()
    assert healthcheck_main([f"127.0.0.1:{free_port()}", "--timeout", "1"]) == 1
    assert time.monotonic() - start < 10


def test_token_required_when_configured(token_service: str) -> None:
    channel, stub = _stub(token_service)
    with channel:
        for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", TOKEN)]):
            with pytest.raises(grpc.RpcError) as err:
                stub.Score(_req("\\boxed{42}"), metadata=metadata, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.ScoreBatch(reward_pb2.ScoreBatchRequest(requests=[_req("42")]), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        auth = [("authorization", f"Bearer {TOKEN}")]
        assert stub.Score(_req("\\boxed{42}"), metadata=auth, timeout=5).reward == 1.0
        reply = stub.ScoreBatch(reward_pb2.ScoreBatchRequest(requests=[_req("42")]), metadata=auth, timeout=5)
        assert [r.reward for r in reply.responses] == [1.0]
    # probes cannot send metadata: health stays open
    assert check(token_service)[0]


def test_sigterm_stops_gracefully() -> None:
    proc, address = _start()
    assert _stop(proc) == 0
    assert not check(address, timeout_s=0.5)[0]
