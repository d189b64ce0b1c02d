"""Fuzzing the Reward service: the example math scorer (examples/reward_service.py) as its own process.

Random ScoreRequests (any text, NULs, huge and odd numbers as answers, missing reward_context) and
random bytes as the raw body, to Score and ScoreBatch. The service may say INVALID_ARGUMENT (no
answer key, a body that does not parse) or RESOURCE_EXHAUSTED (over the message limit), never
UNKNOWN or INTERNAL; afterwards it still reports SERVING and scores a correct answer 1.0.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from tests.integration.test_fuzz_grpc import _TEXT, ALLOWED, FUZZ, messages
from tether.redis_server import free_port
from tether.v1 import reward_pb2, reward_pb2_grpc

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "reward_service.py"
SERVICE = reward_pb2.DESCRIPTOR.services_by_name["Reward"]
# Things a math scorer parses: numbers of every shape, fractions, boxed answers, overflow bait.
NUMBERISH = st.one_of(
    _TEXT,
    st.sampled_from(["1/0", "0/0", "1e999999", "-0", "nan", "inf", "1,000", "\\boxed{}", "\\boxed{1/2}", "9" * 5000]),
    st.integers().map(str),
    st.floats().map(repr),
    st.fractions().map(str),
)
CONTEXT = st.one_of(st.dictionaries(_TEXT, _TEXT, max_size=3), st.fixed_dictionaries({"answer": NUMBERISH}))


@pytest.fixture(scope="module")
def channel(tmp_path_factory) -> grpc.Channel:
    port = free_port()
    log = tmp_path_factory.mktemp("reward") / "reward.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--port", str(port), "--host", "127.0.0.1", "--token", ""],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(ch).result(timeout=60)
        yield ch
        assert proc.poll() is None, log.read_text()
    finally:
        ch.close()
        proc.terminate()
        proc.wait(timeout=30)


def _code(fn, request, timeout_s: float = 30) -> grpc.StatusCode:
    try:
        fn(request, timeout=timeout_s)
    except grpc.RpcError as e:
        assert e.code() in ALLOWED, f"{e.code().name}: {e.details()}"
        return e.code()
    return grpc.StatusCode.OK


def score_requests() -> st.SearchStrategy[reward_pb2.ScoreRequest]:
    return messages(SERVICE.methods_by_name["Score"].input_type, overrides={"completion": NUMBERISH}).flatmap(
        lambda req: CONTEXT.map(lambda ctx: _with_context(req, ctx))
    )


def _with_context(req: reward_pb2.ScoreRequest, ctx: dict[str, str]) -> reward_pb2.ScoreRequest:
    out = reward_pb2.ScoreRequest()
    out.CopyFrom(req)
    out.reward_context.clear()
    out.reward_context.update(ctx)
    return out


@FUZZ
@given(request=score_requests())
def test_fuzz_score(channel: grpc.Channel, request: reward_pb2.ScoreRequest) -> None:
    _code(reward_pb2_grpc.RewardStub(channel).Score, request)


@FUZZ
@given(requests=st.lists(score_requests(), max_size=5))
def test_fuzz_score_batch(channel: grpc.Channel, requests: list[reward_pb2.ScoreRequest]) -> None:
    _code(reward_pb2_grpc.RewardStub(channel).ScoreBatch, reward_pb2.ScoreBatchRequest(requests=requests))


@FUZZ
@given(name=st.sampled_from(["Score", "ScoreBatch"]), body=st.binary(max_size=256))
def test_fuzz_raw_bytes(channel: grpc.Channel, name: str, body: bytes) -> None:
    _code(channel.unary_unary(f"/{SERVICE.full_name}/{name}"), body)


def test_still_serving_and_scoring(channel: grpc.Channel) -> None:
    for _ in range(50):  # the health status is set right after bind; give the loop a moment if needed
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        if reply.status == health_pb2.HealthCheckResponse.SERVING:
            break
        time.sleep(0.1)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    ok = reward_pb2.ScoreRequest(completion="so \\boxed{42}", reward_context={"answer": "42"})
    assert reward_pb2_grpc.RewardStub(channel).Score(ok, timeout=10).reward == 1.0
