"""The request bodies of the OpenAI-compatible door, as agents send them (validated by pydantic; a field that
fails comes back 400 naming it, in OpenAI's error shape). Fields agents send that change nothing here
(``store``, ``parallel_tool_calls``, ``service_tier``, …) are accepted and ignored; fields that would change the
sampling distribution the learner recomputes (penalties, ``logit_bias``) are refused unless neutral."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str = "{}"


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionSpec(_Body):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionSpec


class _Sampling(_Body):
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    max_tokens: int | None = Field(default=None, gt=0)
    n: int = Field(default=1, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _neutral_penalty(cls, value: float | None) -> float | None:
        if value:
            raise ValueError("not supported: a penalty changes the distribution the learner recomputes; send 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _neutral_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value and any(value.values()):
            raise ValueError("not supported: a bias changes the distribution the learner recomputes")
        return value

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return tuple(x for x in ([self.stop] if isinstance(self.stop, str) else self.stop) if x)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["auto", "none"] | dict[str, Any] | str | None = None
    max_completion_tokens: int | None = Field(default=None, gt=0)
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _no_alternatives(cls, value: int | None) -> int | None:
        if value:
            raise ValueError("not supported: the engines return the sampled token's log-prob only; send 0")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        if value not in (None, "auto", "none"):
            raise ValueError(
                "only 'auto' and 'none' are supported: tether does not constrain decoding, so it cannot force a call"
            )
        return value

    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _sampled_only(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError("at most 1: the engines return the sampled token's log-prob only")
        return value

    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported")
        return value

    def token_limit(self) -> int | None:
        return self.max_tokens


class RewardRequest(_Body):
    reward: float | None = None
    """The agent's reward; left out, the run's reward (``rollout.reward``) scores the transcript."""
    reward_context: dict[str, str] = Field(default_factory=dict)
    """What the run's reward reads beside the text (e.g. ``{"answer": "42"}``), when it scores."""
    reward_components: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
