"""The cache manager's OpenTelemetry instruments: observable, read from its state at collection.

OTel name (unit)                     attributes   meaning
strata.device.memory.total (By)      device       device memory (device="cuda:0", else "host" RAM)
strata.device.memory.free (By)       device       free of it now
strata.device.memory.budget (By)     engine_id    each engine's budget (reported, else resolved
                                                  by GetPlan); engine_id="" is the configured
                                                  --device-memory, present only when set
strata.cache.slots ({slot})          engine_id    slots in the engine's cache
strata.cache.total_pairs ({pair})    engine_id    (layer, expert) pairs of its model
strata.cache.coverage (1)            engine_id    slots / total pairs
strata.cache.lookups ({lookup})      engine_id    counter: routed (token, layer, expert) lookups
strata.cache.hits ({lookup})         engine_id    counter: lookups served from the cache
strata.cache.spilled ({lookup})      engine_id    counter: lookups served from outside the cache
strata.cache.hit_ratio (1)           engine_id    hits / lookups over the engine's latest report
strata.cache.spill_ratio (1)         engine_id    spilled / lookups over the latest report
strata.plan.version (1)              model        latest plan version per model fingerprint
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from services.cachemgr.device import DeviceMemory
from services.cachemgr.manager import CacheManager, EngineFigures


def register_metrics(meter: Meter, manager: CacheManager,
                     read_device: Callable[[], DeviceMemory] | None = None) -> None:
    read_device = read_device or manager.read_device

    def device(attribute: str) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            memory = read_device()
            return [Observation(getattr(memory, attribute), {"device": memory.kind})]
        return observe

    def budget(_: CallbackOptions) -> Iterable[Observation]:
        out = [Observation(e.device_memory_bytes, {"engine_id": e.engine_id})
               for e in manager.snapshot()]
        if manager.device_memory_bytes is not None:
            out.append(Observation(manager.device_memory_bytes, {"engine_id": ""}))
        return out

    def per_engine(value: Callable[[EngineFigures], float]
                   ) -> Callable[[CallbackOptions], Iterable[Observation]]:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value(e), {"engine_id": e.engine_id})
                    for e in manager.snapshot()]
        return observe

    def plan_versions(_: CallbackOptions) -> Iterable[Observation]:
        return [Observation(version, {"model": fingerprint})
                for fingerprint, version in manager.planner.versions().items()]

    gauge, counter = meter.create_observable_gauge, meter.create_observable_counter
    gauge("strata.device.memory.total", [device("total_bytes")], unit="By",
          description="Device memory: CUDA device 0, or host RAM without one")
    gauge("strata.device.memory.free", [device("free_bytes")], unit="By",
          description="Free device memory")
    gauge("strata.device.memory.budget", [budget], unit="By",
          description="Device memory the expert cache may use (configured, and per engine)")
    gauge("strata.cache.slots", [per_engine(lambda e: e.slots)], unit="{slot}",
          description="Slots in the engine's expert cache")
    gauge("strata.cache.total_pairs", [per_engine(lambda e: e.total_pairs)], unit="{pair}",
          description="(layer, expert) pairs of the engine's model")
    gauge("strata.cache.coverage", [per_engine(lambda e: e.coverage)], unit="1",
          description="Slots / total pairs")
    counter("strata.cache.lookups", [per_engine(lambda e: e.lookups)], unit="{lookup}",
            description="Routed (token, layer, expert) lookups in decode")
    counter("strata.cache.hits", [per_engine(lambda e: e.hits)], unit="{lookup}",
            description="Lookups served from the expert cache")
    counter("strata.cache.spilled", [per_engine(lambda e: e.spilled)], unit="{lookup}",
            description="Lookups served from outside the cache (PCIe or host)")
    gauge("strata.cache.hit_ratio", [per_engine(lambda e: e.hit_ratio)], unit="1",
          description="Hits / lookups over the engine's latest report")
    gauge("strata.cache.spill_ratio", [per_engine(lambda e: e.spill_ratio)], unit="1",
          description="Spilled / lookups over the engine's latest report")
    gauge("strata.plan.version", [plan_versions], unit="1",
          description="Latest residency plan version per model fingerprint")
