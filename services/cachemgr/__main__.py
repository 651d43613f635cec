"""`python -m services.cachemgr` (also `strata cachemgr`): parse settings, run the daemon."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.cachemgr.config import SETTINGS, CacheMgrConfig
from services.common.logs import setup_logging
from services.common.profile import ProfileError
from services.common.settings import ConfigError, add_settings, resolve

log = logging.getLogger("strata.cachemgr")


def run(config: CacheMgrConfig) -> None:
    """Serve until SIGTERM/SIGINT. Exits with a one-line reason on a bad profile or port."""
    from services.cachemgr.daemon import serve

    try:
        asyncio.run(serve(config))
    except ProfileError as exc:
        log.error("cannot start: %s", exc)
        raise SystemExit(2) from None
    except OSError as exc:
        log.error("cannot start: %s", exc)
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="strata cachemgr",
        description="Cache manager daemon: expert-cache plans, routing counts, cache metrics.")
    add_settings(parser, SETTINGS)
    args = parser.parse_args(argv)
    setup_logging()
    try:
        config = CacheMgrConfig.from_values(resolve(SETTINGS, args))
    except ConfigError as exc:
        parser.exit(2, f"strata cachemgr: {exc}\n")
    run(config)


if __name__ == "__main__":
    sys.exit(main())
