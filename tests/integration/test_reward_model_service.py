"""``examples/reward_model_service.py`` over real gRPC: concurrent callers are batched by token budget,
and the batched scores equal the model's own score of each sequence alone; bad input is refused."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import grpc
import pytest
import torch

from tether.reward_service import start_server
from tether.v1 import reward_pb2, reward_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from reward_model_service import RewardModel, make_tiny_reward_model


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_reward_model(tmp_path_factory.mktemp("rm"), hidden=64, layers=1)


async def test_concurrent_calls_are_batched_and_score_as_alone(reward_model_dir: Path) -> None:
    service = RewardModel(str(reward_model_dir), max_batch_tokens=2048, batch_wait_ms=20)
    server, _, port = await start_server(service, port=0, host="127.0.0.1")
    rng = random.Random(0)
    groups = [[("".join(rng.choice("abcdefgh ") for _ in range(rng.randint(5, 120))), f"q{g}") for _ in range(4)]
              for g in range(6)]  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            replies = await asyncio.gather(*(
                stub.ScoreBatch(reward_pb2.ScoreBatchRequest(requests=[
                    reward_pb2.ScoreRequest(prompt=p, completion=c) for c, p in group
                ]), timeout=120)
                for group in groups
            ))  # fmt: skip
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.Score(reward_pb2.ScoreRequest(completion_token_ids=[10**6]), timeout=30)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in bad.value.details()
    finally:
        await server.stop(None)
    assert service.forwards < 24  # 24 completions from 6 concurrent callers: batched across calls
    tok, model = service.tokenizer, service.model
    for group, reply in zip(groups, replies, strict=True):
        for (completion, prompt), got in zip(group, reply.responses, strict=True):
            ids = tok(prompt + completion, add_special_tokens=False)["input_ids"]
            with torch.inference_mode():
                alone = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
            torch.testing.assert_close(got.reward, alone, rtol=1e-4, atol=1e-4)
            assert got.components["rm_score"] == got.reward
