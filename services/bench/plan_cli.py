"""`strata plan`: the capacity table (and its inverse); `strata plan fit RESULTS...`.

    strata plan --free-mib 8192 16384 --slot-mib 1.318 --pairs 24576 --reserved-mib 700
    strata plan --model DIR --profile expert-profile.bin --target-tok-s 150
    strata plan --model DIR --trace routing.trace --profile expert-profile.bin   (replayed)
    strata plan --config config.json      (a published model: every format at 24/32/48 GiB)
    strata plan fit bench-a/run.json bench-b/run.json      (stored at $STRATA_HOME/plan/fit.json)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.bench import planner
from services.bench.cli import strata_home
from services.bench.fit import fit_results
from services.bench.planner import MIB, CostModel, Hardware, HitRateModel
from services.bench.report import table
from services.common.profile import Profile, ProfileError
from services.engine.cache.trace import TraceError


def default_fit_path() -> Path:
    return strata_home() / "plan" / "fit.json"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata plan", description=__doc__.strip().splitlines()[0])
    p.add_argument("--free-mib", type=float, nargs="+",
                   help="device memory sizes, one row each (default: 10%%..100%% coverage)")
    p.add_argument("--reserved-mib", type=float, default=700.0)
    p.add_argument("--draft-mib", type=float, default=0.0)
    p.add_argument("--weights-mib", type=float, help="non-expert weights on the device "
                   "(default: 0, or with --model what its tensors hold in --dtype)")
    p.add_argument("--kv-mib", type=float, help="the KV pool (default: 0, or with --model the "
                   "engine's default pool of 4 context windows in --dtype)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--slot-mib", type=float)
    size.add_argument("--slot-bytes", type=int)
    p.add_argument("--pairs", type=int, help="(layer, expert) pairs of the model")
    p.add_argument("--model", type=Path, help="checkpoint directory (slot size and pairs)")
    p.add_argument("--config", type=Path, help="a config.json (or its directory) alone: bytes "
                   "per pair in every expert format and the coverage each --free-mib size gives "
                   "(default 24, 32 and 48 GiB)")
    p.add_argument("--kv-tokens", type=int, default=32768, help="with --config: positions the "
                   "KV pool holds (bf16)")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="with --model: the engine's --dtype (auto: as the checkpoint stores "
                   "its weights), which sets the bytes per expert weight in the slots")
    p.add_argument("--expert-dtype", choices=("auto", "int8", "int4"), default="auto",
                   help="with --model: the engine's --expert-dtype; int8/int4 slots are the "
                   "quantized blob's exact size (auto: --dtype's bytes per weight)")
    p.add_argument("--profile", type=Path, help="expert-profile.bin: hit rate from its "
                   "decode cumulative distribution (with --trace: the pre-fill ranking)")
    p.add_argument("--trace", type=Path, help="routing trace (engine --record-routing; may be "
                   "gzipped, .gz): hit rate by replaying it through the recorded cache policy "
                   "at each size")
    p.add_argument("--fit", type=Path, help="cost model from `strata plan fit` "
                   "(default: $STRATA_HOME/plan/fit.json when present)")
    p.add_argument("--target-tok-s", type=float, help="inverse: memory needed for this decode "
                   "speed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _hardware(a: argparse.Namespace, fit: dict | None) -> Hardware:
    slot_bytes, pairs = a.slot_bytes, a.pairs
    if a.slot_mib is not None:
        slot_bytes = round(a.slot_mib * MIB)
    if a.expert_dtype != "auto" and (a.model is None or slot_bytes):
        raise ValueError(f"--expert-dtype {a.expert_dtype} needs --model DIR (the slot size "
                         "follows the expert shape) and no --slot-mib/--slot-bytes")
    weight_bytes = kv_bytes = 0
    if a.model is not None:
        from services.engine.model.checkpoint import load_model_config
        from services.engine.runner import fixed_bytes_of, slot_bytes_of

        c = load_model_config(a.model)
        # what the engine logs at start for the same settings
        slot_bytes = slot_bytes or slot_bytes_of(a.model, a.dtype, a.expert_dtype)
        pairs = pairs or c.total_pairs
        weight_bytes, kv_bytes = fixed_bytes_of(a.model, a.dtype)
    if a.weights_mib is not None:
        weight_bytes = round(a.weights_mib * MIB)
    if a.kv_mib is not None:
        kv_bytes = round(a.kv_mib * MIB)
    hw = (fit or {}).get("hardware") or {}
    slot_bytes, pairs = slot_bytes or hw.get("slot_bytes"), pairs or hw.get("total_pairs")
    if not slot_bytes or not pairs:
        raise ValueError("need the slot size and pair count: --slot-mib/--slot-bytes and "
                         "--pairs, or --model DIR, or a fit made on bench results")
    return Hardware(int(slot_bytes), int(pairs), round(a.reserved_mib * MIB),
                    round(a.draft_mib * MIB), weight_bytes, kv_bytes)


def _load_fit(path: Path | None) -> dict | None:
    path = path or (default_fit_path() if default_fit_path().is_file() else None)
    if path is None:
        return None
    fit = json.loads(Path(path).read_text())
    fit["path"] = str(path)
    return fit


def _hit_model(a: argparse.Namespace, hw: Hardware, fit: dict | None) -> HitRateModel | None:
    profile = Profile.read(a.profile) if a.profile is not None else None
    if profile is not None and profile.total_pairs != hw.total_pairs:
        raise ValueError(f"profile has {profile.total_pairs} pairs, the model {hw.total_pairs}")
    if a.trace is not None:
        trace = planner.read_trace(a.trace)
        if trace.total_pairs != hw.total_pairs:
            raise ValueError(f"trace has {trace.total_pairs} pairs, the model {hw.total_pairs}")
        fill = profile.top_pairs(len(profile.ranked)) if profile is not None else None
        return planner.trace_hit_rate(trace, fill, label=a.trace.name)
    if profile is not None:
        return planner.profile_hit_rate(profile)
    fit_hw = (fit or {}).get("hardware") or {}
    if fit and fit.get("hit_points") and fit_hw.get("total_pairs") == hw.total_pairs:
        return planner.measured_hit_rate([tuple(p) for p in fit["hit_points"]], hw.total_pairs)
    return None


def plan_main(argv: list[str]) -> int:
    if argv[:1] == ["fit"]:
        return fit_main(argv[1:])
    a = _parser().parse_args(argv)
    if a.config is not None:
        return _config_main(a)
    try:
        fit = _load_fit(a.fit)
        hw = _hardware(a, fit)
        hits = _hit_model(a, hw, fit)
    except (ValueError, OSError, ProfileError, TraceError, KeyError) as exc:
        print(f"strata plan: {exc}", file=sys.stderr)
        return 2
    cost = CostModel.from_dict(fit["cost_model"]) if fit else None
    sizes = ([round(m * MIB) for m in a.free_mib] if a.free_mib
             else planner.default_free_sizes(hw))
    result: dict = {"rows": planner.plan_table(hw, sizes, hits, cost),
                    "inputs": {"slot_bytes": hw.slot_bytes, "pairs": hw.total_pairs,
                               "expert_dtype": a.expert_dtype,
                               "reserved_mib": hw.reserved_bytes / MIB,
                               "draft_mib": hw.draft_bytes / MIB,
                               "weights_mib": hw.weight_bytes / MIB,
                               "kv_mib": hw.kv_bytes / MIB,
                               "hit_rate_source": hits.source if hits else None,
                               "profile": str(a.profile) if a.profile else None,
                               "trace": str(a.trace) if a.trace else None,
                               "fit": fit.get("path") if fit else None,
                               "fit_error": fit.get("error", {}).get("rms_rel_error")
                               if fit else None,
                               "fit_basis": fit["cost_model"].get("basis") if fit else None}}
    if a.target_tok_s is not None:
        if hits is None or cost is None:
            print("strata plan: --target-tok-s needs a hit-rate source (--trace, --profile, or a fit "
                  "with measured hit rates) and a cost model (--fit)", file=sys.stderr)
            return 2
        result["target"] = planner.plan_inverse(hw, a.target_tok_s, hits, cost)
    if a.json:
        print(json.dumps(result))
    else:
        _print_plan(result)
    return 0


def _config_main(a: argparse.Namespace) -> int:
    from services.bench.config_plan import config_plan, render
    from services.engine.model.checkpoint import load_model_config
    from services.engine.model.config import CheckpointError
    from services.engine.model.families import parse_config

    path = a.config if a.config.is_file() else a.config / "config.json"
    try:
        raw = json.loads(path.read_text()) if path.is_file() else {}  # (a GGUF directory)
        config = parse_config(raw) if a.config.is_file() else load_model_config(a.config)
    except (CheckpointError, OSError, json.JSONDecodeError) as exc:
        print(f"strata plan: {exc}", file=sys.stderr)
        return 2
    quant = raw.get("quantization_config") or {}
    fp8_block = (tuple(quant.get("weight_block_size") or (128, 128))
                 if quant.get("quant_method") == "fp8" else None)
    sizes = a.free_mib or [24 * 1024, 32 * 1024, 48 * 1024]
    plan = config_plan(config, a.kv_tokens, a.reserved_mib, fp8_block)  # type: ignore[arg-type]
    if a.json:
        print(json.dumps({"pairs": config.total_pairs, "weights_bytes": plan.weight_bytes,
                          "kv_bytes": plan.kv_bytes, "kv_tokens": plan.kv_tokens,
                          "state_bytes_per_sequence": config.linear_state_bytes,
                          "device_mib": sizes,
                          "formats": plan.rows([round(m * MIB) for m in sizes])}))
    else:
        print(render(plan, sizes, str(a.config)))
    return 0


def _print_plan(result: dict) -> None:
    def cell(row: dict, key: str, digits: int) -> str:
        value, basis = row[key], row["basis"].get(key)
        return "-" if value is None else f"{value:.{digits}f} ({basis})"

    print(table(["device MiB", "slots", "cache GiB", "coverage", "expected hit rate",
                 "expected decode tok/s"],
                [[f"{r['free_mib']:.0f}", r["slots"], f"{r['cache_gib']:.2f}",
                  f"{r['coverage']:.1%}", cell(r, "hit_rate", 3), cell(r, "decode_tok_s", 1)]
                 for r in result["rows"]]))
    i = result["inputs"]
    experts = "" if i.get("expert_dtype", "auto") == "auto" else f" ({i['expert_dtype']})"
    print(f"\nslot {i['slot_bytes']} bytes{experts}, {i['pairs']} pairs, "
          f"{i['weights_mib']:.1f} MiB weights, {i['kv_mib']:.1f} MiB KV, "
          f"{i['reserved_mib']:.0f} MiB reserved, {i['draft_mib']:.0f} MiB draft head; "
          "hit rate from "
          f"{i['hit_rate_source'] or 'nothing (give --trace, --profile or a fit)'}; cost model "
          f"{i['fit'] or 'none (run strata plan fit)'}")
    if i.get("fit_basis"):
        print(f"cost model: {i['fit_basis']}")
    t = result.get("target")
    if t and t["reachable"]:
        print(f"target {t['target_tok_s']} tok/s: {t['free_bytes'] / MIB:.1f} MiB of device "
              f"memory -> {t['slots']} slots, hit rate {t['hit_rate']:.3f}, "
              f"{t['decode_tok_s']:.1f} tok/s ({t['basis']['decode_tok_s']})")
    elif t:
        print(f"target {t['target_tok_s']} tok/s is out of reach: at best "
              f"{t['best_decode_tok_s']} tok/s with {t['best_slots']} slots")


def fit_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="strata plan fit", description="Fit the decode cost model "
                                "on bench result JSONs and store it with its error.")
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--output", type=Path, help="where to store it (default: "
                   "$STRATA_HOME/plan/fit.json)")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    try:
        fit = fit_results(a.results)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        print(f"strata plan fit: {exc}", file=sys.stderr)
        return 2
    out = a.output or default_fit_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fit, indent=1) + "\n")
    summary = {k: v for k, v in fit.items() if k != "points"}
    summary["path"] = str(out)
    if a.json:
        print(json.dumps(summary))
    else:
        m, e = fit["cost_model"], fit["error"]
        driver = {"work": "cache work", "fill": "fill rate"}.get(m.get("driver"), "miss rate")
        print(f"decode s/token = {m['base_s'] * 1e3:.3f} ms + {m['per_miss_s'] * 1e3:.3f} ms x "
              f"{driver} ({driver} seen {m['miss_lo']:.3f}..{m['miss_hi']:.3f}); "
              f"{e['num_points']} requests, RMS relative error {e['rms_rel_error']:.1%}")
        print(f"model: {m['basis']}")
        print(table(["slots", "requests", "hit rate p50", "decode tok/s p50", "fitted tok/s",
                     "error"],
                    [[g["slots"], g["num_requests"], f"{g['hit_rate_p50']:.3f}",
                      g["decode_tok_s_p50"], g["predicted_tok_s"], f"{g['rel_error']:+.1%}"]
                     for g in e["by_slots"]]))
        print(f"stored at {out}")
    return 0
