"""`python -m services.gateway`: parse settings, serve until SIGTERM/SIGINT, drain, exit."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys

from aiohttp import web

from services.common.logs import setup_logging
from services.common.settings import ConfigError, add_settings, resolve
from services.common.telemetry import setup_metrics, setup_tracing
from services.gateway.app import drain, init_app
from services.gateway.config import SETTINGS, GatewayConfig

log = logging.getLogger("strata.gateway")
LISTEN_BACKLOG = 2048  # the kernel caps it at net.core.somaxconn (4096 by default)


async def serve(config: GatewayConfig) -> None:
    """Serve until a signal; then drain (readiness fails at once, admitted requests get
    `drain_timeout_s` to finish) and stop. A client that disconnects cancels its handler.
    Metrics: Prometheus on `metrics_port` (0: none), OTLP when OTEL_EXPORTER_OTLP_ENDPOINT."""
    try:
        meter_provider = setup_metrics("strata-gateway", config.metrics_port or None,
                                       config.host)
    except OSError as exc:
        raise ConfigError(f"cannot open the metrics port {config.host}:{config.metrics_port} "
                          f"({exc.strerror}); choose another with --metrics-port / "
                          "STRATA_GATEWAY_METRICS_PORT (0 disables it)") from None
    tracer_provider = setup_tracing("strata-gateway")
    app = init_app(config, meter_provider=meter_provider, tracer_provider=tracer_provider)
    # Requests still running after the drain are cut off promptly, not waited for again.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    # A burst of new connections waits in the kernel's accept queue; at aiohttp's default of
    # 128 a larger burst loses SYNs, and those clients retry a second later.
    site = web.TCPSite(runner, config.host, config.port, backlog=LISTEN_BACKLOG)
    await site.start()
    gc.collect()  # startup's objects out of the collector's sight (see the engine's)
    gc.freeze()
    log.info("gateway listening on http://%s:%d, engines %s%s", config.host, config.port,
             ",".join(config.engine_addrs) or "(none static)",
             f", registry {config.redis_url}" if config.redis_url else "")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await drain(app, config.drain_timeout_s)
    await runner.cleanup()  # cancels whatever is still running
    tracer_provider.shutdown()
    meter_provider.shutdown()
    log.info("gateway stopped")


def run(config: GatewayConfig) -> None:
    asyncio.run(serve(config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata gateway",
                                     description="OpenAI-compatible HTTP gateway for Strata engines")
    add_settings(parser, SETTINGS)
    args = parser.parse_args(argv)
    setup_logging()
    try:
        config = GatewayConfig.from_values(resolve(SETTINGS, args))
    except ConfigError as exc:
        print(f"strata gateway: bad setting: {exc}", file=sys.stderr)
        return 2
    try:
        run(config)
    except ConfigError as exc:
        print(f"strata gateway: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
