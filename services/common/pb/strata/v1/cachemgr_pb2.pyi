from services.common.pb.strata.v1 import counters_pb2 as _counters_pb2
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
    __slots__ = ("engine_id", "model", "device_memory_bytes", "reserved_bytes", "slots")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: ModelShape
    device_memory_bytes: int
    reserved_bytes: int
    slots: int
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[_Union[ModelShape, _Mapping]] = ..., device_memory_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., slots: _Optional[int] = ...) -> None: ...

class WatchPlansRequest(_message.Message):
    __slots__ = ("engine_id", "model", "device_memory_bytes", "reserved_bytes", "known_version", "slots")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: ModelShape
    device_memory_bytes: int
    reserved_bytes: int
    known_version: int
    slots: int
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[_Union[ModelShape, _Mapping]] = ..., device_memory_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., known_version: _Optional[int] = ..., slots: _Optional[int] = ...) -> None: ...

class Pair(_message.Message):
    __slots__ = ("layer", "expert")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("version", "slots", "total_pairs", "pairs", "source", "reason")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAIRS_FIELD_NUMBER: _ClassVar[int]
    PAIRS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    version: int
    slots: int
    total_pairs: int
    pairs: _containers.RepeatedCompositeFieldContainer[Pair]
    source: str
    reason: str
    def __init__(self, version: _Optional[int] = ..., slots: _Optional[int] = ..., total_pairs: _Optional[int] = ..., pairs: _Optional[_Iterable[_Union[Pair, _Mapping]]] = ..., source: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RoutingReport(_message.Message):
    __slots__ = ("engine_id", "model", "counts", "decode", "tokens_generated", "slots", "device_memory_bytes", "reserved_bytes", "plan_version", "link_bytes", "link_busy_s", "requests_running", "requests_waiting", "decode_counts")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LINK_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    DECODE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: ModelShape
    counts: _containers.RepeatedScalarFieldContainer[int]
    decode: _counters_pb2.CacheCounters
    tokens_generated: int
    slots: int
    device_memory_bytes: int
    reserved_bytes: int
    plan_version: int
    link_bytes: int
    link_busy_s: float
    requests_running: int
    requests_waiting: int
    decode_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[_Union[ModelShape, _Mapping]] = ..., counts: _Optional[_Iterable[int]] = ..., decode: _Optional[_Union[_counters_pb2.CacheCounters, _Mapping]] = ..., tokens_generated: _Optional[int] = ..., slots: _Optional[int] = ..., device_memory_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., plan_version: _Optional[int] = ..., link_bytes: _Optional[int] = ..., link_busy_s: _Optional[float] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., decode_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("plan_version",)
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    plan_version: int
    def __init__(self, plan_version: _Optional[int] = ...) -> None: ...

class OverviewRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineOverview(_message.Message):
    __slots__ = ("engine_id", "model", "model_name", "slots", "total_pairs", "coverage", "device_memory_bytes", "plan_version", "lookups", "hits", "spilled", "tokens_generated", "hit_ratio", "spill_ratio", "tokens_per_s", "prefetch_precision", "link_bytes_per_s", "requests_running", "requests_waiting", "seconds_since_report")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAIRS_FIELD_NUMBER: _ClassVar[int]
    COVERAGE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    SPILL_RATIO_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_PRECISION_FIELD_NUMBER: _ClassVar[int]
    LINK_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_REPORT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    model: str
    model_name: str
    slots: int
    total_pairs: int
    coverage: float
    device_memory_bytes: int
    plan_version: int
    lookups: int
    hits: int
    spilled: int
    tokens_generated: int
    hit_ratio: float
    spill_ratio: float
    tokens_per_s: float
    prefetch_precision: float
    link_bytes_per_s: float
    requests_running: int
    requests_waiting: int
    seconds_since_report: float
    def __init__(self, engine_id: _Optional[str] = ..., model: _Optional[str] = ..., model_name: _Optional[str] = ..., slots: _Optional[int] = ..., total_pairs: _Optional[int] = ..., coverage: _Optional[float] = ..., device_memory_bytes: _Optional[int] = ..., plan_version: _Optional[int] = ..., lookups: _Optional[int] = ..., hits: _Optional[int] = ..., spilled: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., hit_ratio: _Optional[float] = ..., spill_ratio: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., prefetch_precision: _Optional[float] = ..., link_bytes_per_s: _Optional[float] = ..., requests_running: _Optional[int] = ..., requests_waiting: _Optional[int] = ..., seconds_since_report: _Optional[float] = ...) -> None: ...

class ModelOverview(_message.Message):
    __slots__ = ("model", "model_name", "plan_version", "source", "drift", "watched_slots")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    PLAN_VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    WATCHED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_name: str
    plan_version: int
    source: str
    drift: float
    watched_slots: int
    def __init__(self, model: _Optional[str] = ..., model_name: _Optional[str] = ..., plan_version: _Optional[int] = ..., source: _Optional[str] = ..., drift: _Optional[float] = ..., watched_slots: _Optional[int] = ...) -> None: ...

class DeviceOverview(_message.Message):
    __slots__ = ("kind", "name", "memory_total_bytes", "memory_used_bytes", "memory_free_bytes", "utilization", "power_w", "temperature_c", "sm_clock_hz", "joules_per_token")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    SM_CLOCK_HZ_FIELD_NUMBER: _ClassVar[int]
    JOULES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    memory_free_bytes: int
    utilization: float
    power_w: float
    temperature_c: float
    sm_clock_hz: float
    joules_per_token: float
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., memory_free_bytes: _Optional[int] = ..., utilization: _Optional[float] = ..., power_w: _Optional[float] = ..., temperature_c: _Optional[float] = ..., sm_clock_hz: _Optional[float] = ..., joules_per_token: _Optional[float] = ...) -> None: ...

class Overview(_message.Message):
    __slots__ = ("engines", "models", "device", "uptime_s", "routing_store")
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    ROUTING_STORE_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineOverview]
    models: _containers.RepeatedCompositeFieldContainer[ModelOverview]
    device: DeviceOverview
    uptime_s: float
    routing_store: str
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineOverview, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelOverview, _Mapping]]] = ..., device: _Optional[_Union[DeviceOverview, _Mapping]] = ..., uptime_s: _Optional[float] = ..., routing_store: _Optional[str] = ...) -> None: ...
