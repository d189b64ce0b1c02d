"""A thin, typed client of a rollout server: ``RolloutClient`` (blocking) and ``AsyncRolloutClient``.

    from tether.client import RolloutClient
    with RolloutClient("127.0.0.1:50051", token=os.environ.get("TETHER_AUTH_TOKEN")) as c:
        out = c.generate(text="digits:", n=4, max_tokens=32)
        ep = c.open_episode(messages=[{"role": "user", "content": "hi"}])
        turn = c.step(ep.episode_id)                      # first model turn
        turn = c.step(ep.episode_id, observation="ok")    # environment text, then a model turn
        c.close_episode(ep.episode_id, reward=1.0)

Responses are the generated protobuf messages (``tether.v1.rollout_pb2``), so there is one schema.
Every call has a deadline (``timeout_s``). UNAVAILABLE (server starting, draining, a connection
blip) is retried by gRPC's own retry policy (set in the channel's service config, with backoff), which
is safe because the server refuses before doing any work. The bearer token goes in ``authorization``
metadata; ``tls_ca`` (a PEM file) switches to TLS. Message limits are set to match the server's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc

from tether.v1 import control_pb2, control_pb2_grpc, rollout_pb2, rollout_pb2_grpc

_RETRY_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "tether.v1.Rollout"}, {"service": "tether.v1.Control"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.2s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def _options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.service_config", _RETRY_CONFIG),
        ("grpc.enable_retries", 1),
    ]


def _sampling(
    *,
    n: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    max_tokens: int = 0,
    stop: Sequence[str] = (),
    seed: int | None = None,
) -> rollout_pb2.SamplingParams:
    s = rollout_pb2.SamplingParams(n=n, top_k=top_k, max_tokens=max_tokens, stop=list(stop))
    if temperature is not None:
        s.temperature = temperature
    if top_p is not None:
        s.top_p = top_p
    if seed is not None:
        s.seed = seed
    return s


def _chat(messages: Sequence[Mapping[str, str]]) -> rollout_pb2.ChatMessages:
    return rollout_pb2.ChatMessages(messages=[rollout_pb2.ChatMessage(**m) for m in messages])


def generate_request(
    *,
    text: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    request_id: str = "",
    **sampling: Any,
) -> rollout_pb2.GenerateRequest:
    """Exactly one of ``text``, ``token_ids``, ``messages``; sampling keywords as in ``SamplingParams``."""
    if sum(x is not None for x in (text, token_ids, messages)) != 1:
        raise ValueError("give exactly one of text, token_ids, messages")
    req = rollout_pb2.GenerateRequest(sampling=_sampling(**sampling), request_id=request_id)
    if text is not None:
        req.text = text
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        req.messages.CopyFrom(_chat(messages or ()))
    return req


def open_episode_request(
    *,
    text: str | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
    group_id: str = "",
    group_size: int = 0,
    metadata: Mapping[str, str] | None = None,
    **sampling: Any,
) -> rollout_pb2.OpenEpisodeRequest:
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text, messages")
    req = rollout_pb2.OpenEpisodeRequest(
        sampling=_sampling(**sampling), group_id=group_id, group_size=group_size, metadata=dict(metadata or {})
    )
    if text is not None:
        req.text = text
    else:
        req.messages.CopyFrom(_chat(messages or ()))
    return req


class _Base:
    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        timeout_s: float = 120.0,
        tls_ca: str | None = None,
        max_message_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
        self._options = _options(max_message_bytes)

    def _kw(self, timeout_s: float | None) -> dict[str, Any]:
        return {"timeout": timeout_s or self.timeout_s, "metadata": self.metadata}


class RolloutClient(_Base):
    """Blocking client; use as a context manager or call :meth:`close`."""

    def __init__(self, address: str, **kw: Any) -> None:
        super().__init__(address, **kw)
        if self._creds is not None:
            self.channel = grpc.secure_channel(address, self._creds, options=self._options)
        else:
            self.channel = grpc.insecure_channel(address, options=self._options)
        self.rollout = rollout_pb2_grpc.RolloutStub(self.channel)
        self.control = control_pb2_grpc.ControlStub(self.channel)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Wait until the server accepts a connection (a server loads its engine before it listens), at most
        ``timeout_s``; then :class:`TimeoutError` naming the address, not grpc's bare FutureTimeoutError."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            from tether.reachability import unreachable_reason

            why = unreachable_reason(self.address, timeout_s=1.0) or "it accepts TCP but does not speak gRPC"
            raise TimeoutError(
                f"no rollout server answered at {self.address} within {timeout_s:g}s ({why}) — start one (tether up "
                "or tether rollout; its address is in the log line rollout_server_ready) or fix the address"
            ) from None

    def generate(self, *, timeout_s: float | None = None, **kw: Any) -> rollout_pb2.GenerateResponse:
        return self.rollout.Generate(generate_request(**kw), **self._kw(timeout_s))

    def generate_stream(self, *, timeout_s: float | None = None, **kw: Any) -> Iterator[rollout_pb2.GenerateChunk]:
        yield from self.rollout.GenerateStream(generate_request(**kw), **self._kw(timeout_s))

    def open_episode(self, *, timeout_s: float | None = None, **kw: Any) -> rollout_pb2.OpenEpisodeResponse:
        return self.rollout.OpenEpisode(open_episode_request(**kw), **self._kw(timeout_s))

    def step(
        self, episode_id: str, observation: str = "", *, role: str = "", timeout_s: float | None = None
    ) -> rollout_pb2.StepResponse:
        req = rollout_pb2.StepRequest(episode_id=episode_id, observation=observation, observation_role=role)
        return self.rollout.Step(req, **self._kw(timeout_s))

    def close_episode(
        self,
        episode_id: str,
        *,
        reward: float,
        components: Mapping[str, float] | None = None,
        metadata: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> rollout_pb2.CloseEpisodeResponse:
        req = rollout_pb2.CloseEpisodeRequest(
            episode_id=episode_id,
            reward=reward,
            reward_components=dict(components or {}),
            metadata=dict(metadata or {}),
        )
        return self.rollout.CloseEpisode(req, **self._kw(timeout_s))

    def status(self, *, timeout_s: float | None = None) -> rollout_pb2.ServerStatus:
        return self.rollout.GetStatus(rollout_pb2.GetStatusRequest(), **self._kw(timeout_s))

    def pause(self, inflight: str = "", *, timeout_s: float | None = None) -> control_pb2.PauseResponse:
        """``inflight``: "keep", "drain" or "" (the server's default)."""
        req = control_pb2.PauseRequest(inflight=_inflight(inflight))
        return self.control.Pause(req, **self._kw(timeout_s))

    def resume(self, *, timeout_s: float | None = None) -> control_pb2.ResumeResponse:
        return self.control.Resume(control_pb2.ResumeRequest(), **self._kw(timeout_s))


class AsyncRolloutClient(_Base):
    """grpc.aio client (create it inside the event loop that uses it)."""

    def __init__(self, address: str, **kw: Any) -> None:
        super().__init__(address, **kw)
        if self._creds is not None:
            self.channel = grpc.aio.secure_channel(address, self._creds, options=self._options)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=self._options)
        self.rollout = rollout_pb2_grpc.RolloutStub(self.channel)
        self.control = control_pb2_grpc.ControlStub(self.channel)

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, *, timeout_s: float | None = None, **kw: Any) -> rollout_pb2.GenerateResponse:
        return await self.rollout.Generate(generate_request(**kw), **self._kw(timeout_s))

    async def generate_stream(
        self, *, timeout_s: float | None = None, **kw: Any
    ) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        async for chunk in self.rollout.GenerateStream(generate_request(**kw), **self._kw(timeout_s)):
            yield chunk

    async def open_episode(self, *, timeout_s: float | None = None, **kw: Any) -> rollout_pb2.OpenEpisodeResponse:
        return await self.rollout.OpenEpisode(open_episode_request(**kw), **self._kw(timeout_s))

    async def step(
        self, episode_id: str, observation: str = "", *, role: str = "", timeout_s: float | None = None
    ) -> rollout_pb2.StepResponse:
        req = rollout_pb2.StepRequest(episode_id=episode_id, observation=observation, observation_role=role)
        return await self.rollout.Step(req, **self._kw(timeout_s))

    async def close_episode(
        self,
        episode_id: str,
        *,
        reward: float,
        components: Mapping[str, float] | None = None,
        timeout_s: float | None = None,
    ) -> rollout_pb2.CloseEpisodeResponse:
        req = rollout_pb2.CloseEpisodeRequest(episode_id=episode_id, reward=reward, reward_components=components)
        return await self.rollout.CloseEpisode(req, **self._kw(timeout_s))

    async def status(self, *, timeout_s: float | None = None) -> rollout_pb2.ServerStatus:
        return await self.rollout.GetStatus(rollout_pb2.GetStatusRequest(), **self._kw(timeout_s))

    async def pause(self, inflight: str = "", *, timeout_s: float | None = None) -> control_pb2.PauseResponse:
        return await self.control.Pause(control_pb2.PauseRequest(inflight=_inflight(inflight)), **self._kw(timeout_s))

    async def resume(self, *, timeout_s: float | None = None) -> control_pb2.ResumeResponse:
        return await self.control.Resume(control_pb2.ResumeRequest(), **self._kw(timeout_s))


def _inflight(value: str) -> int:
    table = {
        "": control_pb2.INFLIGHT_POLICY_UNSPECIFIED,
        "keep": control_pb2.INFLIGHT_POLICY_KEEP,
        "drain": control_pb2.INFLIGHT_POLICY_DRAIN,
    }
    if value not in table:
        raise ValueError(f"inflight must be 'keep', 'drain' or '', got {value!r}")
    return table[value]
