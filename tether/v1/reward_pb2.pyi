from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreRequest(_message.Message):
    __slots__ = ("prompt", "completion", "prompt_token_ids", "completion_token_ids", "reward_context", "trajectory_id")
    class RewardContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REWARD_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    completion: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reward_context: _containers.ScalarMap[str, str]
    trajectory_id: str
    def __init__(self, prompt: _Optional[str] = ..., completion: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., reward_context: _Optional[_Mapping[str, str]] = ..., trajectory_id: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("reward", "components")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    reward: float
    components: _containers.ScalarMap[str, float]
    def __init__(self, reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ScoreBatchRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[ScoreRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[ScoreRequest, _Mapping]]] = ...) -> None: ...

class ScoreBatchResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[ScoreResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[ScoreResponse, _Mapping]]] = ...) -> None: ...
