from tether.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "seed")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages", "sampling", "request_id")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    request_id: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("token_ids", "logprobs", "policy_versions", "text", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _trajectory_pb2.FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_trajectory_pb2.FinishReason, str]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "samples", "logprob_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    logprob_source: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ..., logprob_source: _Optional[str] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("sample_index", "token_ids", "logprobs", "policy_versions", "text", "finish_reason", "prompt_token_ids")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: _trajectory_pb2.FinishReason
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_trajectory_pb2.FinishReason, str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class OpenEpisodeRequest(_message.Message):
    __slots__ = ("text", "messages", "sampling", "group_id", "group_size", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    text: str
    messages: ChatMessages
    sampling: SamplingParams
    group_id: str
    group_size: int
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, text: _Optional[str] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class OpenEpisodeResponse(_message.Message):
    __slots__ = ("episode_id", "prompt_token_ids", "expires_in_ms")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_MS_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    expires_in_ms: int
    def __init__(self, episode_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., expires_in_ms: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "observation", "observation_role")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_ROLE_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    observation: str
    observation_role: str
    def __init__(self, episode_id: _Optional[str] = ..., observation: _Optional[str] = ..., observation_role: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("text", "token_ids", "logprobs", "policy_versions", "finish_reason", "total_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    policy_versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _trajectory_pb2.FinishReason
    total_tokens: int
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., policy_versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_trajectory_pb2.FinishReason, str]] = ..., total_tokens: _Optional[int] = ...) -> None: ...

class CloseEpisodeRequest(_message.Message):
    __slots__ = ("episode_id", "reward", "reward_components", "metadata")
    class RewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, episode_id: _Optional[str] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CloseEpisodeResponse(_message.Message):
    __slots__ = ("trajectory_id", "group_id", "num_completion_tokens", "group_written")
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUP_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    group_id: str
    num_completion_tokens: int
    group_written: bool
    def __init__(self, trajectory_id: _Optional[str] = ..., group_id: _Optional[str] = ..., num_completion_tokens: _Optional[int] = ..., group_written: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStatus(_message.Message):
    __slots__ = ("server_id", "engine", "model_path", "policy_version", "paused", "running_requests", "queued_requests", "open_episodes", "generated_tokens", "tokens_per_s", "draining")
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    OPEN_EPISODES_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    server_id: str
    engine: str
    model_path: str
    policy_version: int
    paused: bool
    running_requests: int
    queued_requests: int
    open_episodes: int
    generated_tokens: int
    tokens_per_s: float
    draining: bool
    def __init__(self, server_id: _Optional[str] = ..., engine: _Optional[str] = ..., model_path: _Optional[str] = ..., policy_version: _Optional[int] = ..., paused: _Optional[bool] = ..., running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., open_episodes: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...
