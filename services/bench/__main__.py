"""`python -m services.bench bench|plan ...`: the same as `strata bench|plan ...`."""

from __future__ import annotations

import sys

from services.bench.cli import bench_main
from services.bench.plan_cli import plan_main


def main(argv: list[str]) -> int:
    commands = {"bench": bench_main, "plan": plan_main}
    if not argv or argv[0] not in commands:
        print("usage: python -m services.bench bench|plan ...", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
