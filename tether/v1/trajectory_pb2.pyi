import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORTED: _ClassVar[FinishReason]
    FINISH_REASON_ENV_CLOSED: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORTED: FinishReason
FINISH_REASON_ENV_CLOSED: FinishReason

class Trajectory(_message.Message):
    __slots__ = ("id", "group_id", "prompt_token_ids", "completion_token_ids", "behavior_logprobs", "policy_versions", "loss_mask", "reward", "reward_components", "finish_reason", "server_id", "started_at", "finished_at", "metadata", "logprob_source")
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
    ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_SOURCE_FIELD_NUMBER: _ClassVar[int]
    id: str
    group_id: str
    prompt_token_ids: bytes
    completion_token_ids: bytes
    behavior_logprobs: bytes
    policy_versions: bytes
    loss_mask: bytes
    reward: float
    reward_components: _containers.ScalarMap[str, float]
    finish_reason: FinishReason
    server_id: str
    started_at: _timestamp_pb2.Timestamp
    finished_at: _timestamp_pb2.Timestamp
    metadata: _containers.ScalarMap[str, str]
    logprob_source: str
    def __init__(self, id: _Optional[str] = ..., group_id: _Optional[str] = ..., prompt_token_ids: _Optional[bytes] = ..., completion_token_ids: _Optional[bytes] = ..., behavior_logprobs: _Optional[bytes] = ..., policy_versions: _Optional[bytes] = ..., loss_mask: _Optional[bytes] = ..., reward: _Optional[float] = ..., reward_components: _Optional[_Mapping[str, float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., server_id: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., metadata: _Optional[_Mapping[str, str]] = ..., logprob_source: _Optional[str] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("group_id", "prompt_id", "trajectories", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    prompt_id: str
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, group_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("prompt_id", "dataset_index", "text", "token_ids", "reward_context", "issued_at_version", "max_tokens")
    class RewardContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ISSUED_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    dataset_index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    reward_context: _containers.ScalarMap[str, str]
    issued_at_version: int
    max_tokens: int
    def __init__(self, prompt_id: _Optional[str] = ..., dataset_index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., reward_context: _Optional[_Mapping[str, str]] = ..., issued_at_version: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...
