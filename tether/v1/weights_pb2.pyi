from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class GetPlanRequest(_message.Message):
    __slots__ = ("version", "held")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    version: int
    held: int
    def __init__(self, version: _Optional[int] = ..., held: _Optional[int] = ...) -> None: ...

class GetPlanResponse(_message.Message):
    __slots__ = ("manifests",)
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    manifests: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, manifests: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetChunkRequest(_message.Message):
    __slots__ = ("hash", "wait_s")
    HASH_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    hash: str
    wait_s: float
    def __init__(self, hash: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class ChunkPiece(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...
