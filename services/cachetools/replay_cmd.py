"""`strata cache replay`: a recorded routing trace through the engine's own residency code.

    strata cache replay TRACE --slots N [--policy P] [--pinned-fraction F] [--prefetch]
    strata cache replay TRACE --sweep [--plot hit-rate.png] [--json]

Prints the decode hit rate the engine would have had with N slots, next to the Belady (MIN)
oracle's for the same size. Policy settings default to those the trace was recorded with, so
replaying at the recorded size reproduces the live figures exactly. `--sweep` gives the curve
over coverage 5-100% (and `--plot` draws it with static, LRU and Belady for comparison).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.profile import Profile, ProfileError
from services.engine.cache.policy import (
    DEFAULT_ADMIT_PREFILL,
    DEFAULT_CRF_LAMBDA,
    DEFAULT_PINNED_FRACTION,
    DEFAULT_POLICY,
    POLICIES,
    Pair,
    PolicySpec,
)
from services.engine.cache.replay import belady, replay
from services.engine.cache.trace import Trace, TraceError

SWEEP = tuple(c / 100 for c in range(5, 101, 5))


@dataclass(frozen=True)
class Point:
    slots: int
    coverage: float
    hit_rate: float
    belady: float
    lookups: int
    hits: int
    prefetch_precision: float
    prefetch_recall: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def slots_for(coverage: float, total_pairs: int) -> int:
    return min(total_pairs, round(coverage * total_pairs))


def replay_point(trace: Trace, slots: int, spec: PolicySpec, prefetch: bool,
                 fill: Sequence[Pair] | None = None, with_belady: bool = True) -> Point:
    result = replay(trace.records, slots, spec, prefetch=prefetch, fill=fill)
    oracle = belady(trace.records, slots, fill=fill).decode.hit_rate if with_belady else 0.0
    d = result.decode
    return Point(slots, slots / trace.total_pairs, d.hit_rate, oracle, d.lookups, d.hits,
                 d.prefetch_precision, d.prefetch_recall)


def spec_from(meta: dict, args: argparse.Namespace) -> PolicySpec:
    def pick(name: str, default: object) -> object:
        value = getattr(args, name)
        return value if value is not None else meta.get(name, default)

    return PolicySpec(str(pick("policy", DEFAULT_POLICY)),
                      float(pick("pinned_fraction", DEFAULT_PINNED_FRACTION)),  # type: ignore[arg-type]
                      float(pick("crf_lambda", DEFAULT_CRF_LAMBDA)),  # type: ignore[arg-type]
                      bool(meta.get("admit_prefill", DEFAULT_ADMIT_PREFILL)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata cache replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path, help="routing trace written with --record-routing")
    parser.add_argument("--slots", type=int, help="cache size (default: the recorded one)")
    parser.add_argument("--policy", choices=POLICIES, help="default: the recorded one")
    parser.add_argument("--pinned-fraction", type=float, help="default: the recorded one")
    parser.add_argument("--crf-lambda", type=float, help="default: the recorded one")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=None,
                        help="replay next-layer prefetch (default: as recorded)")
    parser.add_argument("--profile", type=Path,
                        help="pre-fill from this expert-profile.bin instead of the recorded fill")
    parser.add_argument("--sweep", action="store_true", help="coverage 5%%..100%% in 5%% steps")
    parser.add_argument("--plot", type=Path, help="with --sweep: write the curves as a PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        trace = Trace.read(args.trace)
        spec = spec_from(trace.meta, args)
        fill = None
        if args.profile:
            profile = Profile.read(args.profile)
            profile.validate(str(trace.meta.get("fingerprint", "")), trace.num_layers,
                             trace.num_experts)
            fill = profile.top_pairs(trace.total_pairs)
    except (TraceError, ProfileError, ValueError) as exc:
        print(f"strata cache replay: {exc}", file=sys.stderr)
        return 1
    prefetch = args.prefetch if args.prefetch is not None else bool(trace.meta.get("prefetch"))
    if args.sweep:
        return _sweep(trace, spec, prefetch, fill, args)
    slots = args.slots if args.slots is not None else int(trace.meta.get("slots", 0))
    point = replay_point(trace, slots, spec, prefetch, fill)
    if args.json:
        print(json.dumps({"trace": str(args.trace), "policy": spec.name,
                          "pinned_fraction": spec.pinned_fraction, "prefetch": prefetch,
                          **point.as_dict()}))
        return 0
    print(f"replay {args.trace}: {point.lookups} decode lookups; {slots} slots (coverage "
          f"{point.coverage:.1%}), policy {spec.label}{', prefetch' if prefetch else ''}: "
          f"hit rate {point.hit_rate:.1%} ({point.hits} hits); Belady (MIN) {point.belady:.1%} "
          f"(regret {100 * (point.belady - point.hit_rate):.1f} points)")
    return 0


def _sweep(trace: Trace, spec: PolicySpec, prefetch: bool, fill: Sequence[Pair] | None,
           args: argparse.Namespace) -> int:
    baselines = {"static": PolicySpec("static"), "lru": PolicySpec("lru", 0.0, admit_prefill=True)}
    rows = []
    curves: dict[str, list[tuple[float, float]]] = {spec.label: [], "static": [], "lru": [],
                                                    "belady": []}
    for coverage in SWEEP:
        slots = slots_for(coverage, trace.total_pairs)
        point = replay_point(trace, slots, spec, prefetch, fill)
        row = {**point.as_dict()}
        for name, base in baselines.items():
            row[name] = replay(trace.records, slots, base, prefetch=False,
                               fill=fill).decode.hit_rate
            curves[name].append((point.coverage, row[name]))
        curves[spec.label].append((point.coverage, point.hit_rate))
        curves["belady"].append((point.coverage, point.belady))
        rows.append(row)
        if not args.json:
            print(f"coverage {point.coverage:6.1%} ({slots:5d} slots): {spec.name} "
                  f"{point.hit_rate:6.1%}  static {row['static']:6.1%}  lru {row['lru']:6.1%}  "
                  f"belady {point.belady:6.1%}", flush=True)
    if args.plot:
        from services.cachetools.plot import plot_hit_rates

        plot_hit_rates(curves, args.plot, f"replay of {args.trace.name}")
        if not args.json:
            print(f"wrote {args.plot}")
    if args.json:
        print(json.dumps({"trace": str(args.trace), "policy": spec.name,
                          "pinned_fraction": spec.pinned_fraction, "prefetch": prefetch,
                          "points": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
