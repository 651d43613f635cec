from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CacheCounters(_message.Message):
    __slots__ = ("lookups", "hits", "misses_host", "misses_copied", "fills", "prefetch_fills", "predicted", "predicted_routed", "routed_with_prediction", "reasons")
    class ReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_HOST_FIELD_NUMBER: _ClassVar[int]
    MISSES_COPIED_FIELD_NUMBER: _ClassVar[int]
    FILLS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FILLS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_ROUTED_FIELD_NUMBER: _ClassVar[int]
    ROUTED_WITH_PREDICTION_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hits: int
    misses_host: int
    misses_copied: int
    fills: int
    prefetch_fills: int
    predicted: int
    predicted_routed: int
    routed_with_prediction: int
    reasons: _containers.ScalarMap[str, int]
    def __init__(self, lookups: _Optional[int] = ..., hits: _Optional[int] = ..., misses_host: _Optional[int] = ..., misses_copied: _Optional[int] = ..., fills: _Optional[int] = ..., prefetch_fills: _Optional[int] = ..., predicted: _Optional[int] = ..., predicted_routed: _Optional[int] = ..., routed_with_prediction: _Optional[int] = ..., reasons: _Optional[_Mapping[str, int]] = ...) -> None: ...
