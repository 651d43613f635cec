"""`python -m services.gateway`: parse settings, serve until interrupted."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from services.common.logs import setup_logging
from services.common.settings import ConfigError, add_settings, resolve
from services.gateway.app import init_app
from services.gateway.config import SETTINGS, GatewayConfig

log = logging.getLogger("strata.gateway")


def run(config: GatewayConfig) -> None:
    """Serve until SIGINT/SIGTERM. A client that disconnects cancels its handler (and engine call)."""
    log.info("gateway listening on http://%s:%d, engines %s", config.host, config.port,
             ",".join(config.engine_addrs))
    web.run_app(init_app(config), host=config.host, port=config.port, handler_cancellation=True,
                print=None, access_log=None)


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
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
