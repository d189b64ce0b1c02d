"""OpenAI-shaped bodies: errors, chat and text completions (whole and as SSE chunks), and tether's extension.

Every choice carries ``tether`` — the sampled ``token_ids``, their behaviour ``logprobs`` and ``policy_versions``
— so a client can check what will be trained on without decoding anything; the response's top-level ``tether``
says which episode the turn belongs to and whether it branched.
"""

from __future__ import annotations

import json
import time
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from rollout_server.engines.base import FINISH_ABORTED, FINISH_LENGTH, FINISH_STOP, Completion

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}


def error(status: int, message: str, *, param: str | None = None, code: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def finish_reason(sample: Completion, calls: list[dict[str, Any]]) -> str:
    if calls and sample.finish_reason == FINISH_STOP:
        return "tool_calls"
    return {FINISH_STOP: "stop", FINISH_LENGTH: "length", FINISH_ABORTED: "abort"}.get(sample.finish_reason, "stop")


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """OpenAI leaves the stop sequence out of the text (the trained ids keep the token that completed it)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


class StopHold:
    """A streamed reply's text with OpenAI's stop semantics: text that may be the start of a stop string is held
    back until the next piece says whether it is; from a stop string on nothing more is sent."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.held, self.stopped = stops, "", False

    def push(self, piece: str, *, final: bool) -> str:
        if self.stopped:
            return ""
        text = self.held + piece
        cut = cut_at_stop(text, self.stops)
        if len(cut) < len(text):
            self.stopped, self.held = True, ""
            return cut
        keep = 0 if final else max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


def extension(sample: Completion) -> dict[str, Any]:
    return {"token_ids": sample.token_ids, "logprobs": sample.logprobs, "policy_versions": sample.versions}


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each sampled token's own text (special tokens spelled out): what OpenAI's log-prob entries name."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def token_logprobs(tokenizer: Any, sample: Completion) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: each sampled token with its log-prob (no alternatives)."""
    return [
        {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
        for text, lp in zip(token_texts(tokenizer, sample.token_ids), sample.logprobs, strict=True)
    ]


def usage(prompt_tokens: int, samples: list[Completion]) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def envelope(kind: str, rid: str, model: str, **fields: Any) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, **fields}


def sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"
