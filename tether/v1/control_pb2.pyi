from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InflightPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INFLIGHT_POLICY_UNSPECIFIED: _ClassVar[InflightPolicy]
    INFLIGHT_POLICY_KEEP: _ClassVar[InflightPolicy]
    INFLIGHT_POLICY_DRAIN: _ClassVar[InflightPolicy]
INFLIGHT_POLICY_UNSPECIFIED: InflightPolicy
INFLIGHT_POLICY_KEEP: InflightPolicy
INFLIGHT_POLICY_DRAIN: InflightPolicy

class PauseRequest(_message.Message):
    __slots__ = ("inflight",)
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    inflight: InflightPolicy
    def __init__(self, inflight: _Optional[_Union[InflightPolicy, str]] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("policy_version", "inflight_requests")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    inflight_requests: int
    def __init__(self, policy_version: _Optional[int] = ..., inflight_requests: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape", "bucket", "offset_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    bucket: int
    offset_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., bucket: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("dtype", "num_bytes")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    num_bytes: int
    def __init__(self, dtype: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class FilesystemSource(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CollectiveSource(_message.Message):
    __slots__ = ("backend", "init_method", "world_size", "rank", "group_epoch", "src_rank", "segment_min_bytes")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INIT_METHOD_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SRC_RANK_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    init_method: str
    world_size: int
    rank: int
    group_epoch: int
    src_rank: int
    segment_min_bytes: int
    def __init__(self, backend: _Optional[str] = ..., init_method: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., group_epoch: _Optional[int] = ..., src_rank: _Optional[int] = ..., segment_min_bytes: _Optional[int] = ...) -> None: ...

class WeightUpdatePlan(_message.Message):
    __slots__ = ("version", "filesystem", "collective", "tensors", "buckets", "inflight", "update_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILESYSTEM_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    filesystem: FilesystemSource
    collective: CollectiveSource
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    inflight: InflightPolicy
    update_id: str
    def __init__(self, version: _Optional[int] = ..., filesystem: _Optional[_Union[FilesystemSource, _Mapping]] = ..., collective: _Optional[_Union[CollectiveSource, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ..., inflight: _Optional[_Union[InflightPolicy, str]] = ..., update_id: _Optional[str] = ...) -> None: ...

class PrepareWeightUpdateResponse(_message.Message):
    __slots__ = ("current_version", "ready")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    ready: bool
    def __init__(self, current_version: _Optional[int] = ..., ready: _Optional[bool] = ...) -> None: ...

class CommitWeightUpdateRequest(_message.Message):
    __slots__ = ("update_id", "version")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    version: int
    def __init__(self, update_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class CommitWeightUpdateResponse(_message.Message):
    __slots__ = ("policy_version", "bytes_received", "load_seconds", "checksums")
    class ChecksumsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    bytes_received: int
    load_seconds: float
    checksums: _containers.ScalarMap[str, float]
    def __init__(self, policy_version: _Optional[int] = ..., bytes_received: _Optional[int] = ..., load_seconds: _Optional[float] = ..., checksums: _Optional[_Mapping[str, float]] = ...) -> None: ...

class AbortWeightUpdateRequest(_message.Message):
    __slots__ = ("update_id", "reason")
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    update_id: str
    reason: str
    def __init__(self, update_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortWeightUpdateResponse(_message.Message):
    __slots__ = ("policy_version",)
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    def __init__(self, policy_version: _Optional[int] = ...) -> None: ...
