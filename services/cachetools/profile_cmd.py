"""`strata cache profile`: build an expert-profile.bin from recorded routing traces.

    strata cache profile TRACE [TRACE ...] --output expert-profile.bin [--slots N] [--phase P]

Pairs are ranked by the tokens routed to them over all traces (which must come from the same
model); the profile carries the traces' model fingerprint, so an engine refuses it for another.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from services.common.profile import Profile, ProfileError
from services.engine.cache.trace import DECODE, PREFILL, Trace, TraceError

PHASES = {"decode": (DECODE,), "prefill": (PREFILL,), "all": (DECODE, PREFILL)}


def build_profile(traces: Sequence[Trace], phase: str = "all", built_for_slots: int = 0
                  ) -> Profile:
    """Rank every pair of the traces' model by routed tokens in `phase`; the decode tokens are
    kept alongside (the capacity planner's hit rate is computed on them)."""
    first = traces[0].meta
    counts = np.zeros((traces[0].num_layers, traces[0].num_experts), dtype=np.int64)
    decode = np.zeros_like(counts)
    for t in traces:
        if (t.meta.get("fingerprint"), t.num_layers, t.num_experts) != (
                first.get("fingerprint"), traces[0].num_layers, traces[0].num_experts):
            raise TraceError("traces come from different models (fingerprint or shape differ)")
        counts += t.routing_counts(PHASES[phase])
        decode += t.routing_counts((DECODE,))
    return Profile.from_counts(counts, str(first.get("fingerprint", "")), built_for_slots,
                               decode_counts=decode if phase != "prefill" else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata cache profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path, help="routing traces (--record-routing)")
    parser.add_argument("--output", "-o", type=Path, default=Path("expert-profile.bin"))
    parser.add_argument("--slots", type=int, default=0,
                        help="cache size the profile is built for (0: unknown)")
    parser.add_argument("--phase", choices=sorted(PHASES), default="all",
                        help="which steps' routing to count")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        traces = [Trace.read(p) for p in args.traces]
        profile = build_profile(traces, args.phase, args.slots)
        profile.write(args.output)
    except (TraceError, ProfileError, OSError) as exc:
        print(f"strata cache profile: {exc}", file=sys.stderr)
        return 1
    routed = sum(count for _, _, count in profile.ranked)
    top = profile.ranked[: max(1, profile.total_pairs // 4)]
    share = sum(c for _, _, c in top) / routed if routed else 0.0
    if args.json:
        print(json.dumps({"output": str(args.output), "pairs": len(profile.ranked),
                          "routed": routed, "fingerprint": profile.fingerprint,
                          "top_quarter_share": share}))
    else:
        print(f"wrote {args.output}: {len(profile.ranked)} ranked pairs of "
              f"{profile.num_layers}x{profile.num_experts} (model {profile.fingerprint}) from "
              f"{routed} routed tokens in {len(traces)} trace(s); the hottest 25% of pairs "
              f"took {share:.1%} of them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
