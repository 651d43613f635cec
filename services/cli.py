"""The `strata` command.

    strata up                 the whole cluster on this machine (redis, cachemgr, engine, gateway)
    strata gateway|engine|cachemgr   one service, configured by flags or STRATA_* variables
    strata model demo         write a random-weight checkpoint (tests, benchmarks)
    strata model train-demo   train a small MoE on the Python standard library
    strata model train-mtp    train a multi-token-prediction draft head (--spec-method mtp)
    strata model routing      routing statistics of the trained model (train vs held-out text)
    strata top                live view of engines, queue, hit rate, spill, coverage, tok/s
    strata bench run|sweep|soak|overload|longctx|dataset   measure a running cluster
    strata bench cache        cache policies on held-out prompts (static, LRU, default, Belady)
    strata bench engine       prefill/decode tok/s in-process vs the memory-bandwidth bound
    strata bench spec         speculative decoding: tok/s, expert reads per token, acceptance
    strata bench grammar      constrained decoding: tok/s with and without, mask time per step
    strata bench quant        quantized experts: held-out perplexity and top-1 agreement
    strata cache profile|replay   build expert-profile.bin from traces; replay a routing trace
    strata plan [fit]         capacity table: memory -> coverage -> hit rate -> tok/s
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.common.settings import (
    ConfigError,
    non_negative_int,
    parse_bytes,
    positive_float,
    positive_int,
)


def _service_main(module: str, function: str = "main"):
    def run(argv: list[str]) -> int:
        import importlib

        return getattr(importlib.import_module(module), function)(argv)
    return run


def _bench(argv: list[str]) -> int:
    if argv[:1] == ["cache"]:  # the cache-policy bench runs the model in-process
        from services.cachetools.bench_cmd import main as bench_cache

        return bench_cache(argv[1:])
    if argv[:1] == ["quality"]:  # records the quality set with the in-process reference path
        from services.bench.reference import main as bench_quality

        return bench_quality(argv[1:])
    if argv[:1] == ["quant"]:  # quantized experts: held-out perplexity, top-1 agreement
        from services.bench.quant_bench import main as bench_quant

        return bench_quant(argv[1:])
    if argv[:1] == ["spec"]:  # speculative decoding in-process: speed, expert reads, acceptance
        from services.bench.spec_bench import main as bench_spec

        return bench_spec(argv[1:])
    if argv[:1] == ["grammar"]:  # constrained decoding's cost in-process: masks per step
        from services.bench.grammar_bench import main as bench_grammar

        return bench_grammar(argv[1:])
    if argv[:1] == ["engine"]:  # decode speed of the model in-process, vs the bandwidth bound
        from services.bench.engine_bench import main as bench_engine

        return bench_engine(argv[1:])
    from services.bench.cli import bench_main

    return bench_main(argv)


def _cache(argv: list[str]) -> int:
    commands = {"profile": "services.cachetools.profile_cmd",
                "replay": "services.cachetools.replay_cmd"}
    if not argv or argv[0] not in commands:
        print("usage: strata cache profile|replay ...  (--help on each)", file=sys.stderr)
        return 2
    return _service_main(commands[argv[0]])(argv[1:])


def _up(argv: list[str]) -> int:
    from services.engine.model.demo import strata_home
    from services.launcher import RestartPolicy, UpConfig, run_up

    parser = argparse.ArgumentParser(prog="strata up", description="Start redis, the cache "
                                     "manager, one engine and the gateway on this machine.")
    parser.add_argument("--model", help="checkpoint directory (default: the shipped "
                        "strata-stdlib-moe)")
    parser.add_argument("--device-memory", help="engine device memory budget, e.g. 768MiB")
    parser.add_argument("--max-inflight", type=positive_int, help="requests at the engine")
    parser.add_argument("--max-queue", type=non_negative_int, help="requests waiting at the gateway")
    parser.add_argument("--port", type=non_negative_int, default=8000, help="gateway HTTP port")
    parser.add_argument("--engine-port", type=positive_int, default=50051)
    parser.add_argument("--cachemgr-port", type=positive_int, default=50061)
    parser.add_argument("--metrics-port", type=positive_int, default=9464,
                        help="cache manager's Prometheus endpoint")
    parser.add_argument("--gateway-metrics-port", type=positive_int, default=None,
                        help="gateway's Prometheus endpoint (default: 9465, or a free port)")
    parser.add_argument("--engine-metrics-port", type=positive_int, default=None,
                        help="engine's Prometheus endpoint (default: 9466, or a free port)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where each service's log goes (default: $STRATA_HOME/run)")
    parser.add_argument("--quiet", action="store_true", help="do not echo service logs")
    parser.add_argument("--max-deaths", type=positive_int, default=RestartPolicy.max_deaths,
                        help="a child that dies this many times within --death-window-s is "
                        "crash-looping and stops the cluster (default: %(default)s); before "
                        "that each death is restarted after a doubling backoff")
    parser.add_argument("--death-window-s", type=positive_float,
                        default=RestartPolicy.window_s, help="(default: %(default)s)")
    args = parser.parse_args(argv)
    if args.device_memory:
        try:
            parse_bytes(args.device_memory)
        except ValueError as exc:
            raise ConfigError(f"--device-memory={args.device_memory!r}: {exc}") from None
    return run_up(UpConfig(
        model=args.model, device_memory=args.device_memory, max_inflight=args.max_inflight,
        max_queue=args.max_queue, port=args.port, engine_port=args.engine_port,
        cachemgr_port=args.cachemgr_port, metrics_port=args.metrics_port,
        log_dir=args.log_dir or strata_home() / "run", echo=not args.quiet,
        gateway_metrics_port=args.gateway_metrics_port,
        engine_metrics_port=args.engine_metrics_port),
        RestartPolicy(max_deaths=args.max_deaths, window_s=args.death_window_s))


def _model(argv: list[str]) -> int:
    if argv[:1] == ["train-demo"]:  # trains on the standard library; its own flags
        from services.training.cli import main as train_demo

        return train_demo(argv[1:])
    if argv[:1] == ["train-mtp"]:  # a draft head for a trained checkpoint; its own flags
        from services.training.mtp import main as train_mtp

        return train_mtp(argv[1:])
    if argv[:1] == ["routing"]:  # routing statistics of a trained checkpoint; its own flags
        from services.training.routing import main as routing

        return routing(argv[1:])
    from services.engine.model.demo import (
        PRESETS,
        demo_model_dir,
        write_demo_checkpoint,
    )

    parser = argparse.ArgumentParser(prog="strata model", description="Model checkpoints.")
    sub = parser.add_subparsers(dest="action", required=True)
    demo = sub.add_parser("demo", help="write a random-weight checkpoint (tests, benchmarks)")
    sub.add_parser("train-demo", help="train a small MoE on the Python standard library "
                   "(strata model train-demo --help)")
    sub.add_parser("train-mtp", help="train a multi-token-prediction draft head for a "
                   "trained checkpoint (strata model train-mtp --help)")
    sub.add_parser("routing", help="routing statistics of a trained checkpoint on training "
                   "and held-out text (strata model routing --help)")
    demo.add_argument("--output", type=Path, default=None,
                      help="directory to write (default: "
                      "$STRATA_HOME/models/strata-PRESET-moe, strata-demo-moe for demo)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--preset", choices=list(PRESETS), default="demo",
                      help="demo: small and quick (tests); bench: the standard shape for "
                      "`strata bench engine` figures; qwen3-30b-a3b: that model's per-layer "
                      "shape in bf16, 12 layers (15.1 GiB)")
    demo.add_argument("--layers", type=positive_int, help="decoder layers (default: the "
                      "preset's)")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    output = args.output or demo_model_dir(args.preset)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    path = write_demo_checkpoint(output, seed=args.seed, preset=args.preset,
                                 progress=lambda line: print(line, file=sys.stderr, flush=True),
                                 **overrides)
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    if args.json:
        print(json.dumps({"path": str(path), "bytes": size, "seed": args.seed,
                          "preset": args.preset}))
    else:
        print(f"wrote the demo checkpoint to {path} ({size / 2**20:.1f} MiB, seed {args.seed})")
    return 0


COMMANDS = {
    "up": _up,
    "gateway": _service_main("services.gateway.__main__"),
    "engine": _service_main("services.engine.__main__"),
    "cachemgr": _service_main("services.cachemgr.__main__"),
    "model": _model,
    "top": _service_main("services.top"),
    "bench": _bench,
    "cache": _cache,
    "plan": _service_main("services.bench.plan_cli", "plan_main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help"} or argv[0] not in COMMANDS:
        print(__doc__.strip())
        if argv and argv[0] not in {"-h", "--help"}:
            print(f"\nstrata: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as exc:
        print(f"strata {argv[0]}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
