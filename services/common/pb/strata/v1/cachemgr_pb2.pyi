from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelShape(_message.Message):
    __slots__ = ("fingerprint", "name", "num_layers", "num_experts", "experts_per_token", "slot_bytes")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    name: str
    num_layers: int
    num_experts: int
    experts_per_token: int
    slot_bytes: int
    def __init__(self, fingerprint: _Optional[str] = ..., name: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., experts_per_token: _Optional[int] = ..., slot_bytes: _Optional[int] = ...) -> None: ...

class GetPlanRequest(_message.Message):
    __slots__ = ("engine_id", "model", "device_memory_bytes", "reserved_bytes")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: ModelShape
    device_memory_bytes: int
    reserved_bytes: int
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[_Union[ModelShape, _Mapping]] = ..., device_memory_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ...) -> None: ...

class Pair(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("version", "slots", "total_pairs", "pairs", "source")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAIRS_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    version: int
    slots: int
    total_pairs: int
    pairs: _containers.RepeatedCompositeFieldContainer[Pair]
    source: str
    def __init__(self, version: _Optional[int] = ..., slots: _Optional[int] = ..., total_pairs: _Optional[int] = ..., pairs: _Optional[_Iterable[_Union[Pair, _Mapping]]] = ..., source: _Optional[str] = ...) -> None: ...

class RoutingReport(_message.Message):
    __slots__ = ("engine_id", "model", "counts", "lookups", "hits", "spilled", "tokens_generated", "slots", "device_memory_bytes", "reserved_bytes", "plan_version")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: ModelShape
    counts: _containers.RepeatedScalarFieldContainer[int]
    lookups: int
    hits: int
    spilled: int
    tokens_generated: int
    slots: int
    device_memory_bytes: int
    reserved_bytes: int
    plan_version: int
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[_Union[ModelShape, _Mapping]] = ..., counts: _Optional[_Iterable[int]] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., spilled: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., slots: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., plan_version: _Optional[int] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("plan_version",)
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    plan_version: int
    def __init__(self, plan_version: _Optional[int] = ...) -> None: ...
