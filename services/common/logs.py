"""One log format for every Strata process."""

from __future__ import annotations

import logging
import os


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("STRATA_LOG_LEVEL", "INFO")).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%Y-%m-%dT%H:%M:%S", force=True)
    # The handler keeps the level too: a logger set lower elsewhere (a library, a debugger)
    # does not make DEBUG lines, which may quote requests, reach the process's output.
    for handler in logging.root.handlers:
        handler.setLevel(level)
    # gRPC/HTTP client libraries are chatty at INFO; operators want Strata's own lines.
    for noisy in ("urllib3", "httpx", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
