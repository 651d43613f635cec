"""The cache manager's OpenTelemetry instruments: observable, read from its state at collection.

OTel name (unit)                        attributes  meaning
strata.device.memory.total (By)         device      device memory (device="cuda:0", else "host")
strata.device.memory.used (By)          device      used of it
strata.device.memory.free (By)          device      free of it
strata.device.memory.budget (By)        engine_id   each engine's budget (reported, else resolved
                                                    by GetPlan); engine_id="" is the configured
                                                    --device-memory, present only when set
strata.device.utilization (1)           device      busy share (GPU utilisation, else CPU)
strata.device.power (W)                 device      power draw (GPU only)
strata.device.temperature (Cel)         device      temperature (GPU only)
strata.device.sm_clock (Hz)             device      SM clock (GPU; CPU clock on a host)
strata.device.energy (J)                device      counter: energy used since the daemon started
strata.energy.per_token (J)             device      joules per generated token, last minute
strata.cache.slots ({slot})             engine_id   slots in the engine's cache
strata.cache.total_pairs ({pair})       engine_id   (layer, expert) pairs of its model
strata.cache.coverage (1)               engine_id   slots / total pairs
strata.cache.lookups ({lookup})         engine_id   counter: routed (token, layer, expert) lookups
strata.cache.hits ({lookup})            engine_id   counter: lookups served from the cache
strata.cache.spilled ({lookup})         engine_id   counter: lookups served from outside the cache
strata.cache.hit_ratio (1)              engine_id   hits / lookups over the engine's latest report
strata.cache.spill_ratio (1)            engine_id   spilled / lookups over the latest report
strata.cache.prefetch.precision (1)     engine_id   prefetches used / issued (engines that say)
strata.link.bandwidth (By/s)            engine_id   host -> device copy rate (engines that say)
strata.engine.tokens ({token})          engine_id   counter: tokens generated
strata.engine.token_rate ({token}/s)    engine_id   tokens per second over the latest report
strata.engine.requests.running ({request}) engine_id   requests decoding (engines that say)
strata.engine.requests.waiting ({request}) engine_id   requests queued at the engine
strata.engine.plan.version (1)          engine_id   the plan version the engine applies
strata.plan.version (1)                 model       latest plan version per model fingerprint
strata.profile.drift (1)                model       routed work the pinned set misses that the
                                                    best set of its size would serve
strata.profile.served_ratio (1)         model       routed work the pinned set serves (the
                                                    profile's expected hit ratio)

On the Prometheus endpoint the names use `_` and carry the unit: strata_device_memory_total_bytes,
strata_device_power_watts, strata_device_energy_joules_total, strata_energy_per_token_joules,
strata_cache_lookups_total, strata_link_bandwidth_bytes_per_second, ... (see tests/cachemgr).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from services.cachemgr.device import DeviceSample
from services.cachemgr.manager import CacheManager, EngineFigures
from services.cachemgr.planner import ModelStatus

Observe = Callable[[CallbackOptions], Iterable[Observation]]


def register_metrics(meter: Meter, manager: CacheManager) -> None:
    def device(value: Callable[[DeviceSample], float | None]) -> Observe:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            sample = manager.device()
            figure = value(sample)
            return [] if figure is None else [Observation(figure, {"device": sample.kind})]
        return observe

    def joules_per_token(_: CallbackOptions) -> Iterable[Observation]:
        value = manager.energy.joules_per_token()
        return [] if value is None else [Observation(value, {"device": manager.device().kind})]

    def budget(_: CallbackOptions) -> Iterable[Observation]:
        out = [Observation(e.device_memory_bytes, {"engine_id": e.engine_id})
               for e in manager.snapshot()]
        if manager.device_memory_bytes is not None:
            out.append(Observation(manager.device_memory_bytes, {"engine_id": ""}))
        return out

    def per_engine(value: Callable[[EngineFigures], float | None]) -> Observe:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(v, {"engine_id": e.engine_id})
                    for e in manager.snapshot() if (v := value(e)) is not None]
        return observe

    def per_model(value: Callable[[ModelStatus], float]) -> Observe:
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value(m), {"model": m.fingerprint})
                    for m in manager.planner.status()]
        return observe

    gauge, counter = meter.create_observable_gauge, meter.create_observable_counter
    for name, unit, read, text in (
        ("total", "By", lambda d: d.total_bytes, "Device memory: GPU 0, or host RAM without one"),
        ("used", "By", lambda d: d.used_bytes, "Used device memory"),
        ("free", "By", lambda d: d.free_bytes, "Free device memory"),
    ):
        gauge(f"strata.device.memory.{name}", [device(read)], unit=unit, description=text)
    gauge("strata.device.memory.budget", [budget], unit="By",
          description="Device memory the expert cache may use (configured, and per engine)")
    gauge("strata.device.utilization", [device(lambda d: d.utilization)], unit="1",
          description="Busy share of the device (GPU utilisation, else CPU)")
    gauge("strata.device.power", [device(lambda d: d.power_w)], unit="W",
          description="Power draw of the GPU")
    gauge("strata.device.temperature", [device(lambda d: d.temperature_c)], unit="Cel",
          description="GPU temperature")
    gauge("strata.device.sm_clock", [device(lambda d: d.sm_clock_hz)], unit="Hz",
          description="SM clock of the GPU (CPU clock on a host without one)")
    counter("strata.device.energy", [device(lambda d: d.energy_j)], unit="J",
            description="Energy the GPU used since the cache manager started")
    gauge("strata.energy.per_token", [joules_per_token], unit="J",
          description="Joules per generated token over the last minute")

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
            description="Lookups served by no cache slot: run from host memory or copied "
                        "over the link first")
    gauge("strata.cache.hit_ratio", [per_engine(lambda e: e.latest_hit_ratio)], unit="1",
          description="Hits / lookups over the engine's latest report")
    gauge("strata.cache.spill_ratio", [per_engine(lambda e: e.latest_spill_ratio)], unit="1",
          description="Spilled / lookups over the engine's latest report")
    gauge("strata.cache.prefetch.precision", [per_engine(lambda e: e.prefetch_precision)],
          unit="1", description="Prefetched experts used / prefetched, latest report")
    gauge("strata.link.bandwidth", [per_engine(lambda e: e.link_bytes_per_s)], unit="By/s",
          description="Host -> device copy bandwidth while copying, latest report")
    counter("strata.engine.tokens", [per_engine(lambda e: e.tokens_generated)], unit="{token}",
            description="Tokens generated by the engine")
    gauge("strata.engine.token_rate", [per_engine(lambda e: e.tokens_per_s)], unit="{token}/s",
          description="Tokens per second over the engine's latest report")
    gauge("strata.engine.requests.running", [per_engine(lambda e: e.requests_running)],
          unit="{request}", description="Requests the engine is decoding")
    gauge("strata.engine.requests.waiting", [per_engine(lambda e: e.requests_waiting)],
          unit="{request}", description="Requests queued at the engine")
    gauge("strata.engine.plan.version", [per_engine(lambda e: e.plan_version)], unit="1",
          description="The plan version the engine says it applies")

    gauge("strata.plan.version", [per_model(lambda m: m.version)], unit="1",
          description="Latest residency plan version per model fingerprint")
    gauge("strata.profile.drift", [per_model(lambda m: m.drift)], unit="1",
          description="Share of routed work the pinned set misses that the best set would serve")
    gauge("strata.profile.served_ratio", [per_model(lambda m: m.served_share)], unit="1",
          description="Share of routed work the pinned set serves (expected hit ratio)")
