"""`strata bench cache`: expert-cache hit rates on held-out prompts.

    strata bench cache [--model DIR] [--json] [--plot hit-rate.png]

1. Decode a *profile* prompt set with sampling (temperature 0.8), recording routing; rank the
   pairs by routed tokens: the profile. With `--text stdlib` (default) the prompts are code
   snippets from the training split of the default model's corpus (the Python standard
   library), continued as raw text; with `--text topics`, chat questions on a set of topics.
2. Decode a disjoint *held-out* prompt set the same way, recording routing: snippets of the
   held-out modules (`stdlib`), or questions on other topics (`topics`).
3. Replay the held-out trace (the engine's own residency code; outputs do not depend on the
   cache, so a replay is what the engine would have done live) at 10/25/50% coverage, all
   pre-filled from the profile: static (every slot pinned), plain LRU (no pinned core, every
   miss admitted, prefill's too), the engine's default policy (and prefetch setting), and the
   Belady (MIN) oracle.

Sampling, not greedy: greedy decoding of a small model falls into repetition cycles that make a
trace degenerate. Progress goes to stderr.

`--speed` also decodes the held-out set live at 25% coverage (`--device`, default cuda when
visible) with next-layer prefetch on and off, and reports decode tok/s of each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from services.cachetools.plot import plot_hit_rates
from services.cachetools.profile_cmd import build_profile
from services.cachetools.replay_cmd import SWEEP, slots_for
from services.engine.cache.policy import DEFAULT_PREFETCH, PolicySpec
from services.engine.cache.replay import belady, replay
from services.engine.cache.trace import Trace, TraceWriter

COVERAGES = (0.10, 0.25, 0.50)
TOPICS = (
    "volcanoes", "the french revolution", "sourdough bread", "black holes", "chess openings",
    "honeybees", "the roman empire", "jazz improvisation", "plate tectonics", "origami",
    "electric cars", "the immune system", "medieval castles", "coral reefs", "quantum computing",
    "marathon training", "ancient egypt", "photosynthesis", "the stock market", "glaciers",
    "renaissance painting", "submarines", "tea ceremonies", "desert ecosystems", "compilers",
    "the silk road", "solar panels", "octopuses", "opera", "earthquakes", "knitting",
    "the moon landing", "bird migration", "cryptography", "rainforests", "bicycles",
)
TEMPLATES = (
    "Explain {} to a curious ten-year-old.",
    "Write a short poem about {}.",
    "List three surprising facts about {}.",
    "What are the biggest open questions about {}?",
    "Summarize the history of {} in one paragraph.",
    "Give me a study plan for learning about {}.",
)


def prompt_sets(num_prompts: int, text: str = "topics") -> tuple[list[str], list[str]]:
    """Two disjoint prompt sets of `num_prompts` each: (profile, held-out)."""
    if text == "stdlib":
        from services.training.corpus import snippets

        return snippets("train", num_prompts), snippets("heldout", num_prompts)
    half = len(TOPICS) // 2
    sets = []
    for topics, shift in ((TOPICS[:half], 0), (TOPICS[half:], 3)):
        sets.append([TEMPLATES[(i + shift) % len(TEMPLATES)].format(topics[i % len(topics)])
                     for i in range(num_prompts)])
    return sets[0], sets[1]


def record_trace(runner, prompts: list[str], path: Path, max_tokens: int, temperature: float,
                 seed: int, label: str, chat: bool) -> int:
    """Decode every prompt with sampling while recording routing to `path`; tokens decoded."""
    runner.cache.recorder = TraceWriter(path, runner.trace_meta(prefetch=False))
    runner.fill_cache(runner.layer_order_pairs(), source="layer order")
    total, _ = decode_prompts(runner, prompts, max_tokens, temperature, seed, label, chat)
    runner.cache.recorder.close()
    runner.cache.recorder = None
    return total


def decode_prompts(runner, prompts: list[str], max_tokens: int, temperature: float, seed: int,
                   label: str, chat: bool) -> tuple[int, float]:
    """Sample up to max_tokens per prompt (a user message in the chat template, or raw text to
    continue); (tokens decoded, seconds spent in decode steps)."""
    from services.engine.driver import SequenceDriver
    from services.engine.sampling import Sampler, SamplingConfig

    drive = SequenceDriver(runner)
    t0, total, decode_s = time.perf_counter(), 0, 0.0
    eos = set(runner.tokenizer.eos_token_ids)
    for i, text in enumerate(prompts):
        if chat:
            text = runner.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True)
        ids = runner.tokenizer.encode(text)
        sampler = Sampler(SamplingConfig(temperature=temperature, seed=seed + i))
        seq = drive.start(ids)
        logits = drive.prefill(seq)
        started = time.perf_counter()
        for _ in range(max_tokens):
            token = sampler.sample(logits)
            if token in eos or seq.num_tokens >= seq.max_num_tokens:
                break
            logits = drive.decode(seq, token)
            total += 1
        if runner.device.type == "cuda":
            import torch

            torch.cuda.synchronize(runner.device)
        decode_s += time.perf_counter() - started
        drive.release(seq)
        print(f"bench cache: {label} set {i + 1}/{len(prompts)} prompts, {total} tokens "
              f"decoded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    drive.close()
    return total, decode_s


def measure_speed(model_dir: Path, device: str, fill: list[tuple[int, int]], prompts: list[str],
                  max_tokens: int, temperature: float, seed: int, chat: bool,
                  coverage: float = 0.25) -> dict[str, dict]:
    """Decode tok/s and hit rate at `coverage`, default policy, prefetch on and off."""
    from services.engine.runner import ModelRunner

    out = {}
    for prefetch in (True, False):
        probe = ModelRunner(model_dir, device=device, cache_slots=0, reserved_bytes=0)
        slots = slots_for(coverage, probe.total_pairs)
        runner = ModelRunner(model_dir, device=device, cache_slots=slots, reserved_bytes=0,
                             prefetch=prefetch)
        del probe
        runner.fill_cache(fill, source="profile")
        label = f"speed ({device}, prefetch {'on' if prefetch else 'off'})"
        tokens, decode_s = decode_prompts(runner, prompts, max_tokens, temperature, seed, label,
                                          chat)
        d = runner.cache.decode
        out["prefetch_on" if prefetch else "prefetch_off"] = {
            "decode_tok_s": tokens / decode_s if decode_s else 0.0, "hit_rate": d.hit_rate,
            "tokens": tokens, "prefetch_precision": d.prefetch_precision,
            "prefetch_recall": d.prefetch_recall}
    return out


PLAIN_LRU = PolicySpec("lru", 0.0, admit_prefill=True)


def evaluate(trace: Trace, fill: list[tuple[int, int]], coverages=COVERAGES,
             default: PolicySpec | None = None, prefetch: bool = DEFAULT_PREFETCH,
             progress: bool = False) -> dict[str, dict]:
    """Decode hit rates {coverage: {static, lru, demand, default, belady}} on `trace`. `demand`
    is the default policy without prefetch: Belady's MIN is the optimum of demand paging, so it
    bounds `demand`; prefetch loads pairs before they are routed and can beat it."""
    default = default or PolicySpec()
    out = {}
    for i, coverage in enumerate(coverages):
        if progress:
            print(f"bench cache: replaying coverage {coverage:.0%} ({i + 1}/{len(coverages)})",
                  file=sys.stderr, flush=True)
        slots = slots_for(coverage, trace.total_pairs)
        out[str(coverage)] = {
            "static": replay(trace.records, slots, PolicySpec("static"), prefetch=False,
                             fill=fill).decode.hit_rate,
            "lru": replay(trace.records, slots, PLAIN_LRU, prefetch=False,
                          fill=fill).decode.hit_rate,
            "demand": replay(trace.records, slots, default, prefetch=False,
                             fill=fill).decode.hit_rate,
            "default": replay(trace.records, slots, default, prefetch=prefetch,
                              fill=fill).decode.hit_rate,
            "belady": belady(trace.records, slots, fill=fill).decode.hit_rate,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata bench cache", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        help="checkpoint directory (default: the default model)")
    parser.add_argument("--text", choices=("stdlib", "topics"), default="stdlib",
                        help="stdlib: code snippets, profile from the training split of the "
                        "standard library and measured on held-out modules; topics: chat "
                        "questions on two disjoint topic sets")
    parser.add_argument("--prompts", type=int, default=24, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens decoded per prompt")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-dir", type=Path,
                        help="keep the two routing traces here (default: a temporary dir)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --trace-dir: replay the traces already there, if both are")
    parser.add_argument("--plot", type=Path, help="write hit rate vs coverage (5-100%%) as PNG")
    parser.add_argument("--speed", action="store_true",
                        help="also decode tok/s at 25%% coverage, prefetch on vs off")
    parser.add_argument("--device", default=None, help="for --speed: cpu or cuda (default: "
                        "cuda when visible)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    from services.common.logs import setup_logging
    from services.engine.config import EngineConfig
    from services.engine.runner import ModelRunner

    setup_logging()
    model_dir = args.model or EngineConfig().model_dir
    runner = ModelRunner(model_dir, device="cpu", cache_slots=0, reserved_bytes=0)
    profile_set, held_out = prompt_sets(args.prompts, args.text)
    chat = args.text == "topics"
    with tempfile.TemporaryDirectory() as tmp:
        trace_dir = args.trace_dir or Path(tmp)
        trace_dir.mkdir(parents=True, exist_ok=True)
        paths = trace_dir / "profile-set.trace", trace_dir / "held-out.trace"
        reused = bool(args.reuse and args.trace_dir and all(p.exists() for p in paths))
        for path, prompts, label, seed in ((paths[0], profile_set, "profile", args.seed),
                                           (paths[1], held_out, "held-out", args.seed + 10_000)):
            if reused:
                print(f"bench cache: reusing {path}", file=sys.stderr)
                continue
            record_trace(runner, prompts, path, args.max_tokens, args.temperature, seed, label,
                         chat)
        profile = build_profile([Trace.read(paths[0])])
        trace = Trace.read(paths[1])
    fill = profile.top_pairs(profile.total_pairs)
    table = evaluate(trace, fill, progress=True)
    if args.plot:
        curves = evaluate(trace, fill, SWEEP, progress=True)
        plot_hit_rates({name: [(float(c), row[name]) for c, row in curves.items()]
                        for name in ("static", "lru", "demand", "default", "belady")}, args.plot,
                       f"held-out decode hit rate, {runner.model_name} ({trace.total_pairs} "
                       f"pairs)\ndefault = {PolicySpec().label}"
                       f"{' + prefetch' if DEFAULT_PREFETCH else ''}")
        print(f"bench cache: wrote {args.plot}", file=sys.stderr)
    speed = None
    if args.speed:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        speed = measure_speed(model_dir, device, fill, held_out, args.max_tokens,
                              args.temperature, args.seed + 10_000, chat)
    if args.json:
        print(json.dumps({"coverage": table, **({"speed": speed} if speed else {})}))
        return 0
    source = ("training-split snippets", "held-out-module snippets") if args.text == "stdlib" \
        else ("prompts", "others")
    sets = (f"traces reused from {args.trace_dir}" if reused else
            f"profile from {len(profile_set)} {source[0]}, measured on {len(held_out)} "
            f"{source[1]} (temperature {args.temperature}, {args.max_tokens} tokens each)")
    print(f"expert cache on held-out prompts: {runner.model_name}, {trace.total_pairs} pairs, "
          f"{sets}; default policy "
          f"{PolicySpec().label}{' + prefetch' if DEFAULT_PREFETCH else ''}")
    print(f"{'coverage':>8}  {'static':>7}  {'lru':>7}  {'demand':>7}  {'default':>7}  "
          f"{'belady':>7}   (demand: the default policy without prefetch)")
    for coverage, row in table.items():
        print(f"{float(coverage):8.0%}  " + "  ".join(
            f"{row[k]:7.1%}" for k in ("static", "lru", "demand", "default", "belady")))
    for name, row in (speed or {}).items():
        print(f"decode at 25% coverage, {name.replace('_', ' ')}: {row['decode_tok_s']:.1f} "
              f"tok/s, hit rate {row['hit_rate']:.1%} ({row['tokens']} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
