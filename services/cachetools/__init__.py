"""Offline expert-cache tools: `strata cache profile|replay` and `strata bench cache`.

Entry points (each `main(argv) -> exit code`):
    services.cachetools.profile_cmd.main   strata cache profile TRACE... --output PATH
    services.cachetools.replay_cmd.main    strata cache replay TRACE --slots N | --sweep
    services.cachetools.bench_cmd.main     strata bench cache [--model DIR] [--json]
"""
