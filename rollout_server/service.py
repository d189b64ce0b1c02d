"""The ``tether.v1.Rollout`` servicer: Generate, GenerateStream, the episode calls, GetStatus.

Thin on purpose: validation is in ``validation.py``, episodes in ``episodes.py``, generation in the
engine; this file only converts between protobuf and those. A cancelled RPC (client gone or deadline)
cancels the handler task, which aborts the engine request so no compute is spent on it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import grpc

from rollout_server.episodes import EpisodeStore
from rollout_server.state import ServerState
from rollout_server.validation import prompt_ids, sampling_spec
from tether.v1 import rollout_pb2, rollout_pb2_grpc


class IncrementalText:
    """Decoded text of a growing token list, released only once a multi-byte character is complete."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0

    def push(self, ids: list[int], *, final: bool) -> str:
        self.ids += ids
        full = self.tokenizer.decode(self.ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        if full.endswith("\ufffd") and not final:
            return ""  # the last token ends inside a UTF-8 sequence: wait for the rest
        out, self.sent = full[self.sent :], len(full)
        return out


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, state: ServerState, episodes: EpisodeStore) -> None:
        self.state = state
        self.episodes = episodes

    def _inputs(self, request: rollout_pb2.GenerateRequest) -> tuple[list[int], object]:
        s, e = self.state, self.state.engine
        ids = prompt_ids(request, e.tokenizer, s.cfg.rollout, vocab_size=s.vocab_size(), max_model_len=e.max_model_len)
        return ids, sampling_spec(request.sampling, s.cfg.rollout)

    async def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        async with self.state.rpc("Generate", context), self.state.admit():
            ids, spec = self._inputs(request)
            rid = request.request_id or uuid.uuid4().hex
            samples = await self.state.engine.generate(ids, spec, request_id=rid)  # type: ignore[arg-type]
            self.state.metrics.add_tokens(sum(len(x.token_ids) for x in samples))
            return rollout_pb2.GenerateResponse(
                request_id=rid,
                prompt_token_ids=ids,
                logprob_source=self.state.engine.logprob_source,
                samples=[
                    rollout_pb2.Sample(
                        token_ids=x.token_ids,
                        logprobs=x.logprobs,
                        policy_versions=x.versions,
                        text=x.text,
                        finish_reason=x.finish_reason,  # type: ignore[arg-type]
                    )
                    for x in samples
                ],
            )

    async def GenerateStream(
        self, request: rollout_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        async with self.state.rpc("GenerateStream", context), self.state.admit():
            ids, spec = self._inputs(request)
            rid = request.request_id or uuid.uuid4().hex
            engine, metrics = self.state.engine, self.state.metrics
            texts = [IncrementalText(engine.tokenizer) for _ in range(spec.n)]  # type: ignore[attr-defined]
            first, start = True, time.perf_counter()
            agen = engine.stream(ids, spec, request_id=rid)  # type: ignore[arg-type]
            try:
                async for c in agen:
                    if first and c.token_ids:
                        metrics.ttft.observe(time.perf_counter() - start)
                    metrics.add_tokens(len(c.token_ids))
                    yield rollout_pb2.GenerateChunk(
                        sample_index=c.index,
                        token_ids=c.token_ids,
                        logprobs=c.logprobs,
                        policy_versions=c.versions,
                        text=texts[c.index].push(c.token_ids, final=bool(c.finish_reason)),
                        finish_reason=c.finish_reason,  # type: ignore[arg-type]
                        prompt_token_ids=ids if first else (),
                    )
                    first = False
            finally:
                await agen.aclose()  # on cancellation this aborts the engine request

    async def OpenEpisode(self, request: rollout_pb2.OpenEpisodeRequest, context: grpc.aio.ServicerContext):
        async with self.state.rpc("OpenEpisode", context):
            return await self.episodes.open(request)

    async def Step(self, request: rollout_pb2.StepRequest, context: grpc.aio.ServicerContext):
        async with self.state.rpc("Step", context), self.state.admit():
            return await self.episodes.step(request)

    async def CloseEpisode(self, request: rollout_pb2.CloseEpisodeRequest, context: grpc.aio.ServicerContext):
        async with self.state.rpc("CloseEpisode", context):
            return await self.episodes.close(request)

    async def GetStatus(self, request: rollout_pb2.GetStatusRequest, context: grpc.aio.ServicerContext):
        s, e = self.state, self.state.engine
        s.metrics.policy_version.set(e.policy_version)
        return rollout_pb2.ServerStatus(
            server_id=s.server_id,
            engine=e.name,
            model_path=s.cfg.model.path,
            policy_version=e.policy_version,
            paused=e.paused,
            running_requests=e.running_requests,
            queued_requests=e.queued_requests,
            open_episodes=len(self.episodes),
            generated_tokens=s.metrics.total_tokens,
            tokens_per_s=s.metrics.rate,
            draining=s.draining,
        )
