"""`strata engine`: load the model, fill the expert cache, serve gRPC until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import sys

from services.common.logs import setup_logging
from services.common.settings import (
    ConfigError,
    add_settings,
    available_cores,
    format_bytes,
    resolve,
)
from services.engine.config import DEFAULT_CPU_DEVICE_MEMORY, SETTINGS, EngineConfig
from services.engine.spec.base import DraftSource

log = logging.getLogger("strata.engine")


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device={requested}: no CUDA device is visible to this process; "
                          "use --device cpu or check the GPU runtime (nvidia-smi)")
    return requested


def device_budget(config: EngineConfig, device: str) -> tuple[int | None, int | None]:
    """(--device-memory, --cache-slots) for the runner. None for the budget on CUDA means the
    runner reads the driver's free memory. On the CPU with neither given: where every pair's
    slot fits in DEFAULT_CPU_DEVICE_MEMORY, that budget stands in for free VRAM (a small model:
    the cache and its telemetry as a GPU would show them); else no slots, since there the host
    store already
    is the memory the experts are computed from, a slot would be a second copy of its pair, and
    a decode step reads a miss in place at the speed of a hit (the budget is then what the
    weights, the KV pool and the reserve take)."""
    if (config.device_memory is not None or config.cache_slots is not None
            or device.startswith("cuda")):
        return config.device_memory, config.cache_slots
    from services.engine.model.checkpoint import load_model_config
    from services.engine.runner import slot_bytes_of

    pairs = load_model_config(config.model_dir).total_pairs
    slot_bytes = slot_bytes_of(config.model_dir, config.dtype, config.expert_dtype)
    if pairs * slot_bytes <= DEFAULT_CPU_DEVICE_MEMORY:
        log.info("no --device-memory on CPU: using a %s budget standing in for free VRAM",
                 format_bytes(DEFAULT_CPU_DEVICE_MEMORY))
        return DEFAULT_CPU_DEVICE_MEMORY, None
    log.info("no --device-memory on CPU: no cache slots (the %d pairs take %s, more than the %s "
             "a CPU engine mirrors by default; decode reads every expert in place from the host "
             "store). Give --device-memory or --cache-slots to size a cache as a GPU would.",
             pairs, format_bytes(pairs * slot_bytes), format_bytes(DEFAULT_CPU_DEVICE_MEMORY))
    return None, 0


async def serve(config: EngineConfig) -> None:
    from services.common.sizing import BudgetError
    from services.engine.core import Engine
    from services.engine.model.cuda_graphs import MAX_BATCH
    from services.engine.planning import CacheManagerLink, local_plan
    from services.engine.runner import ModelRunner
    from services.engine.server import (
        StatusSource,
        first_token_grace_s,
        set_serving,
        start_server,
    )
    from services.engine.step_trace import StepTrace

    device = resolve_device(config.device)
    try:
        step_trace = StepTrace(config.step_trace) if config.step_trace else None
    except OSError as exc:
        raise ConfigError(f"--step-trace {config.step_trace}: cannot append to it "
                          f"({exc.strerror}); give a writable file or leave it unset") from None
    import torch

    if config.threads:
        torch.set_num_threads(config.threads)
    grace_s = first_token_grace_s(config.first_token_grace_ms, device, torch.get_num_threads(),
                                  available_cores())
    draft_bytes = config.draft_reserve or _draft_bytes(config, device)
    budget, cache_slots = device_budget(config, device)
    try:
        runner = ModelRunner(config.model_dir, device=device, device_memory_bytes=budget,
                             reserved_bytes=config.reserve, cache_slots=cache_slots,
                             policy=config.policy_spec,
                             placement=config.placement, prefetch=config.prefetch,
                             cuda_graphs=config.cuda_graphs,
                             record_routing=config.record_routing,
                             draft_head_bytes=draft_bytes,
                             kv_memory_bytes=config.kv_memory, kv_block_size=config.kv_block_size,
                             dtype=config.dtype, kv_dtype=config.kv_dtype,
                             expert_dtype=config.expert_dtype, cpu_kernels=config.cpu_kernels,
                             graph_batches=range(1, min(config.max_running, MAX_BATCH) + 1),
                             max_running=config.max_running)
    except BudgetError as exc:  # the numbers, and what to change
        raise ConfigError(f"--device-memory / --cache-slots: {exc}") from None
    draft_source = _draft_source(config, runner, device)  # in the room reserved above
    engine = Engine(runner, max_running=config.max_running,
                    max_step_tokens=config.prefill_chunk, draft_source=draft_source,
                    spec_tokens=config.spec_tokens, prefix_reuse=config.prefix_reuse,
                    gather_ms=config.gather_ms, step_trace=step_trace)
    status = StatusSource(engine, "", runner.model_name, device)
    meter_provider, tracer_provider = _telemetry(config)
    server, port, health = await start_server(engine, status, config.host, config.port,
                                              meter_provider=meter_provider,
                                              tracer_provider=tracer_provider,
                                              first_token_grace_s=grace_s)
    status.engine_id = engine_id = config.resolved_engine_id(port)
    link = None
    if config.cachemgr:
        link = CacheManagerLink(config.cachemgr, engine_id, runner)
        try:
            plan = await link.get_plan()
        except Exception as exc:
            log.warning("cache manager at %s did not answer GetPlan (%s); planning locally",
                        config.cachemgr, exc)
            plan = local_plan(runner, config.profile)
    else:
        plan = local_plan(runner, config.profile)
    # The whole ranking: the pre-fill takes the first `slots` pairs; a routing trace keeps all
    # of it so replays at other sizes start from the same ranking.
    runner.fill_cache(plan.pairs, source=plan.source)
    status.plan_version, status.plan_source = plan.version, plan.source
    # What loading made lives as long as the process: out of the collector's sight, a full
    # collection (every ~10 s of serving) walks only what serving made, not a ~70 ms stall of
    # every stream while the loop thread walks the tokenizer, the model and the libraries.
    gc.collect()
    gc.freeze()
    engine.start()
    await set_serving(health, True)
    log.info("engine %s ready: model %s on %s (%d CPU threads, first-token grace %.1f ms), "
             "gRPC on %s:%d", engine_id, runner.model_name, device, torch.get_num_threads(),
             grace_s * 1e3, config.host, port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    registration = await _register(config, engine, engine_id, runner.model_name, port)
    reporter = watcher = None
    if link:
        reporter = asyncio.create_task(link.report_forever(
            engine.totals, lambda: status.plan_version, config.report_interval_s,
            load=lambda: (engine.num_running, engine.num_waiting)))
        watcher = _watch_plans(link, engine, runner, status, config.plan_swap_slots)
    await stop.wait()
    log.info("engine %s stopping: finishing the running request", engine_id)
    if registration:
        await registration.stop()
    if watcher:
        await watcher.stop()
    await set_serving(health, False)
    await server.stop(grace=5.0)
    engine.stop()
    if reporter:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        await link.report(engine.totals, status.plan_version)  # type: ignore[union-attr]
        await link.close()  # type: ignore[union-attr]
    runner.close()
    tracer_provider.shutdown()
    meter_provider.shutdown()
    log.info("engine %s stopped after %d requests", engine_id, engine.totals.requests_finished)


def _draft_bytes(config: EngineConfig, device: str) -> int:
    """Device memory of the draft source, estimated before the expert cache is sized."""
    if not config.spec_tokens:
        return 0
    from services.engine.spec import draft_memory_bytes

    try:
        return draft_memory_bytes(config.spec_method, config.spec_draft_model,
                                  config.model_dir, device)
    except (OSError, ValueError) as exc:
        model = (f", --spec-draft-model={config.spec_draft_model}"
                 if config.spec_method == "draft" else "")
        raise ConfigError(f"--spec-method={config.spec_method} (STRATA_SPEC_METHOD){model}: "
                          f"{exc}") from None


def _draft_source(config: EngineConfig, runner: object, device: str) -> DraftSource | None:
    """The --spec-method draft source when --spec-tokens > 0; a ConfigError when the
    checkpoint cannot give it."""
    if not config.spec_tokens:
        return None
    from services.engine.spec import make_draft_source

    try:
        source = make_draft_source(
            config.spec_method, draft_model=config.spec_draft_model, device=device,
            tokenizer=runner.tokenizer, runner=runner)  # type: ignore[attr-defined]
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--spec-method={config.spec_method} (STRATA_SPEC_METHOD): "
                          f"{exc}") from None
    log.info("speculative decoding: %d draft tokens per step from %s", config.spec_tokens,
             source.describe())
    return source


async def _register(config: EngineConfig, engine: object, engine_id: str, model: str,
                    port: int) -> object | None:
    """Heartbeat into the Redis engine registry, so gateways find this engine and its load."""
    if not config.redis_url:
        return None
    from services.common.registry import EngineLoad, EngineRegistration

    registration = EngineRegistration(
        config.redis_url, engine_id=engine_id, address=config.advertised_address(port),
        model=model,
        load=lambda: EngineLoad(engine.num_running, engine.num_waiting, True))  # type: ignore[attr-defined]
    await registration.start()
    return registration


def _telemetry(config: EngineConfig) -> tuple[object, object]:
    """Request metrics on the Prometheus endpoint (`metrics_port`, 0: none) and/or OTLP; spans
    over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set."""
    from services.common.telemetry import setup_metrics, setup_tracing

    try:
        meter_provider = setup_metrics("strata-engine", config.metrics_port or None, config.host)
    except OSError as exc:
        raise ConfigError(f"cannot open the metrics port {config.host}:{config.metrics_port} "
                          f"({exc.strerror}); choose another with --metrics-port / "
                          "STRATA_ENGINE_METRICS_PORT (0 disables it)") from None
    return meter_provider, setup_tracing("strata-engine")


def _watch_plans(link: object, engine: object, runner: object, status: object,
                 swap_slots: int) -> object:
    """Apply each new plan version from the cache manager between engine steps, at most
    `swap_slots` slots per step (the engine's loop thread owns the cache)."""
    from services.engine.plan_watch import PlanApplier, PlanWatcher

    apply = PlanApplier(engine, runner.cache, status, swap_slots)  # type: ignore[attr-defined]
    watcher = PlanWatcher(link.address, link.engine_id, link.shape(), apply,  # type: ignore[attr-defined]
                          device_memory_bytes=link.device_memory_bytes,  # type: ignore[attr-defined]
                          reserved_bytes=link.reserved_bytes,  # type: ignore[attr-defined]
                          slots=link.slots,  # type: ignore[attr-defined]
                          known_version=status.plan_version)  # type: ignore[attr-defined]
    watcher.start()
    return watcher


def run(config: EngineConfig) -> None:
    setup_logging()
    asyncio.run(serve(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata engine", description=__doc__)
    add_settings(parser, SETTINGS)
    try:
        config = EngineConfig.from_values(resolve(SETTINGS, parser.parse_args(argv)))
        run(config)
    except ConfigError as exc:
        print(f"strata engine: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
