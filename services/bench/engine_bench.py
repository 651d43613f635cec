"""`strata bench engine`: in-process prefill and decode speed against the memory-bandwidth bound.

    strata bench engine [--model DIR] [--prompt-tokens P] [--gen-tokens G] [--batch B]
                        [--repeat R] [--device cpu|cuda] [--coverage C [C ...]]
                        [--prefetch off|on [off|on]] [--policy P] [--placement M]
                        [--cuda-graphs on|off] [--threads N]
                        [--dtype auto|bf16|fp32 [...]] [--expert-dtype auto|int8|int4]
                        [--cpu-kernels auto|on|off]
                        [--compare-hf] [--peer-llama-cpp DIR] [--json] [--out DIR]
    strata bench engine --from-json FILE --out DIR      (the report of a saved result)

1. Load the model with services.engine.runner.ModelRunner on `--device` (expert cache at
   `--coverage`, all of it by default, filled in layer order) and, with `--compare-hf`, the same
   checkpoint in transformers; warm both up.
2. R timed rounds, each: the machine's memory read bandwidth (sum of a 256 MiB fp32 tensor, best
   of 3; copy bandwidth too), then Strata — `runner.step` driven directly: one batched prefill
   step of B prompts of P tokens, then G - 1 batched greedy decode steps (G tokens in all, like
   `generate(max_new_tokens=G)`) on fresh sequences — then transformers `generate()` (greedy,
   same prompts, same G, EOS off; decode tok/s = B * (G - 1) / (t(G) - t(1))). A shared VM's
   bandwidth drifts by 2x within minutes, so each round's decode is set against the bandwidth
   and the HF speed of the same round, and the medians of those per-round ratios are reported.
   With `--peer-llama-cpp DIR` (a llama.cpp build; `--model` a GGUF file) each round also runs
   llama.cpp's own benchmark on the same file (bench/llama_cpp_peer.py), and Strata's decode
   and prefill over llama.cpp's are reported the same way: medians of per-round ratios.
3. Active weight bytes per decode token: the non-expert weights the step reads (attention,
   norms, routers, dense MLPs, lm_head; the embedding row only) once per step, plus the distinct
   routed experts of every MoE layer (K per token at batch 1; at batch B the B*K routed pairs of a
   layer share experts, measured from the run), divided by the B tokens of the step. The bound is
   bandwidth / active bytes; decode's share of it is the headline figure. On CUDA the
   bandwidth is the device's (sum of a 1 GiB tensor), the bound that of an all-hit step.
4. Several dtypes (`--dtype bf16 fp32`): a runner each, loaded side by side, their rounds
   interleaved (the bandwidth drifts between runs), and each dtype's decode over the first's,
   the median of back-to-back rounds' ratios.
5. Several coverages or prefetch settings: one run of steps 1-3 each (HF once, with the first),
   and per prefetch setting the spill penalty — the least-squares slope of decode tok/s over
   the decode spill in points (share of routed experts served from outside the cache), i.e.
   tok/s lost per point of spill.

Entry point: `main(argv) -> int`. With `--json` exactly one JSON object goes to stdout; progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.sizing import proc_kib
from services.engine import kernels
from services.engine.cache.placement import DEFAULT_PLACEMENT, PLACEMENTS
from services.engine.cache.policy import DEFAULT_POLICY, POLICIES, PolicySpec
from services.engine.model.checkpoint import checkpoint_bytes
from services.engine.model.dtypes import DTYPES, dtype_name
from services.engine.model.quant import EXPERT_DTYPES

BANDWIDTH_BYTES = 256 * 2**20
DEVICE_BANDWIDTH_BYTES = 2**30  # several times a GPU's L2
BANDWIDTH_REPEATS = 3  # per round
TEXT = (
    "The quick brown fox jumps over the lazy dog while the old river keeps running to the sea. "
    "Memory bandwidth, not arithmetic, bounds the decode of a sparse mixture of experts. "
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata bench engine", description="In-process prefill "
                                "and decode speed against the memory-bandwidth bound.")
    p.add_argument("--model", type=Path, help="a qwen3_moe checkpoint directory (default: the "
                   "shipped default model)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens per sequence, the first "
                   "from prefill")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--repeat", type=int, default=3, help="timed runs (medians reported)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--coverage", type=float, nargs="+", default=[1.0], help="expert-cache "
                   "slots as a fraction of all (layer, expert) pairs; several: one run each")
    p.add_argument("--prefetch", choices=("off", "on"), nargs="+", default=["off"],
                   help="next-layer prefetch; both: one run each")
    p.add_argument("--policy", choices=POLICIES, default=DEFAULT_POLICY,
                   help="cache policy (see the engine's --policy)")
    p.add_argument("--placement", choices=PLACEMENTS, default=DEFAULT_PLACEMENT,
                   help="miss placement (see the engine's --placement)")
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on", help="CUDA: decode "
                   "steps as graph replays (the engine's --cuda-graphs)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--dtype", choices=DTYPES, nargs="+", default=["auto"], help="the engine's "
                   "--dtype; several: one runner each, their rounds interleaved, and the "
                   "decode ratio of each to the first")
    p.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default="auto", help="expert "
                   "weights in the host store and slots (int8/int4: quantized, as the engine's "
                   "--expert-dtype)")
    p.add_argument("--cpu-kernels", choices=kernels.MODES, default="auto", help="the engine's "
                   "C kernels for CPU decode (off: torch ops only, for comparison)")
    p.add_argument("--compare-hf", action="store_true", help="also time transformers generate()")
    p.add_argument("--peer-llama-cpp", type=Path, metavar="DIR", help="a llama.cpp build "
                   "(scripts/build_llama_cpp.sh): each round also runs llama-bench (batch 1) or "
                   "llama-batched-bench on the same GGUF, and the ratios are reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", type=Path, help="also write engine.json, engine.md and (several "
                   "runs) engine-spill.png, decode tok/s against spill, into this directory")
    p.add_argument("--from-json", type=Path, metavar="FILE", help="render the report of a "
                   "result saved with --json (e.g. on a GPU machine) instead of running")
    return p


def progress(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


class PeakRss:
    """This process's peak resident memory (anonymous and file-backed pages), leaving out the
    bench's own bandwidth probes (512 MiB of buffers on the CPU, freed after each): the
    kernel's high-water mark is read before a probe and reset after it (Linux's
    /proc/self/clear_refs). Where it cannot be reset the figure includes the probes."""

    def __init__(self) -> None:
        self.peak = 0
        self.includes_probes = False

    @staticmethod
    def _hwm() -> int:
        hwm = proc_kib("/proc/self/status", "VmHWM")
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return hwm

    def before_probe(self) -> None:
        self.peak = max(self.peak, self._hwm())

    def after_probe(self) -> None:
        """Once the probe's buffers are freed: the high-water mark back to what is resident."""
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.includes_probes = True

    def value(self) -> int:
        return max(self.peak, self._hwm())


peak_rss = PeakRss()  # the process's, over every runner of the run


def measure_bandwidth(num_bytes: int | None = None, repeats: int = BANDWIDTH_REPEATS,
                      device: torch.device | str = "cpu") -> tuple[float, float]:
    """(read, copy) bandwidth in bytes/s of `device`'s memory, best of `repeats`: `x.sum()`
    reads num_bytes (BANDWIDTH_BYTES by default, DEVICE_BANDWIDTH_BYTES on CUDA); `y.copy_(x)`
    reads and writes them (2 * num_bytes moved)."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    num_bytes = num_bytes or (DEVICE_BANDWIDTH_BYTES if on_cuda else BANDWIDTH_BYTES)
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)

    def timed(fn: Any) -> float:
        if on_cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    timed(x.sum)  # warm-up (kernel load on CUDA)
    read_s = [timed(x.sum) for _ in range(repeats)]
    copy_s = [timed(lambda: y.copy_(x)) for _ in range(repeats)]
    return num_bytes / min(read_s), 2 * num_bytes / min(copy_s)


def prompts(batch: int, num_tokens: int) -> list[list[int]]:
    """B distinct byte-token prompts of num_tokens each (ids < 256, valid in any byte vocab)."""
    data = TEXT.encode() * (1 + (num_tokens + batch * 7) // len(TEXT))
    return [list(data[7 * b : 7 * b + num_tokens]) for b in range(batch)]


def run_strata(runner: Any, batch_prompts: list[list[int]], gen_tokens: int
               ) -> tuple[float, float, list[list[int]], float]:
    """One batched prefill step and gen_tokens - 1 batched greedy decode steps on fresh
    sequences; (prefill_s, decode_s, generated ids per sequence, distinct experts per MoE layer
    per decode step)."""
    from services.engine.driver import SequenceDriver

    drive = SequenceDriver(runner)
    seqs = [drive.start(p, max_num_tokens=len(p) + gen_tokens) for p in batch_prompts]
    t0 = time.perf_counter()
    out = [[int(logits.argmax())] for logits in drive.run([(s, s.num_tokens) for s in seqs])]
    prefill_s = time.perf_counter() - t0
    pairs0, steps0 = runner.cache.distinct_pairs_routed, runner.cache.layer_steps
    t0 = time.perf_counter()
    for _ in range(gen_tokens - 1):
        logits = drive.decode_batch(seqs, [toks[-1] for toks in out])
        for toks, row in zip(out, logits, strict=True):
            toks.append(int(row.argmax()))
    decode_s = time.perf_counter() - t0
    distinct = (runner.cache.distinct_pairs_routed - pairs0) / max(
        1, runner.cache.layer_steps - steps0)
    for s in seqs:
        drive.release(s)
    drive.close()
    return prefill_s, decode_s, out, distinct


class HfGenerate:
    """transformers generate() on the same checkpoint and prompts, loaded once."""

    def __init__(self, model_dir: Path, batch_prompts: list[list[int]], gen_tokens: int,
                 device: torch.device):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval().to(device)
        self.model.generation_config.eos_token_id = None  # exactly G tokens, like Strata's loop
        self.ids = torch.tensor(batch_prompts, device=device)  # [B, P]
        self.gen_tokens = gen_tokens
        self._generate(min(gen_tokens, 4))  # warm-up

    def _generate(self, n: int) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(self.ids, max_new_tokens=n, min_new_tokens=n,
                                      attention_mask=torch.ones_like(self.ids), do_sample=False,
                                      pad_token_id=0)
        out = out.cpu()  # waits for the device
        return time.perf_counter() - t0, out

    def run(self) -> tuple[float, float, list[list[int]]]:
        """(prefill_s, decode_s, generated ids per sequence) of one timed round."""
        t1, _ = self._generate(1)
        tg, out = self._generate(self.gen_tokens)
        return t1, max(tg - t1, 1e-9), out[:, self.ids.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.from_json is not None:
        if args.out is None:
            raise SystemExit("--from-json needs --out DIR")
        out = json.loads(args.from_json.read_text())
        print(json.dumps(write_report(args.out, out)) if args.json else
              f"wrote {write_report(args.out, out)['markdown']}")
        return 0
    if args.gen_tokens < 2 or args.prompt_tokens < 1 or args.batch < 1 or args.repeat < 1:
        raise SystemExit("--gen-tokens >= 2, --prompt-tokens, --batch, --repeat >= 1")
    if not all(0.0 <= c <= 1.0 for c in args.coverage):
        raise SystemExit("--coverage takes fractions in [0, 1]")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    from services.models import default_model_dir

    model_dir = args.model or default_model_dir()
    batch_prompts = prompts(args.batch, args.prompt_tokens)
    runs: list[dict[str, Any]] = []
    hf = None
    peer = None
    if args.peer_llama_cpp is not None:
        from services.bench.llama_cpp_peer import LlamaCppPeer, PeerError

        try:
            peer = LlamaCppPeer(args.peer_llama_cpp, Path(model_dir), args.batch,
                                args.prompt_tokens, args.gen_tokens, torch.get_num_threads())
        except PeerError as e:
            raise SystemExit(str(e)) from e
        progress(f"peer: {peer.describe()}")
    dtypes = list(dict.fromkeys(args.dtype))
    for prefetch in dict.fromkeys(args.prefetch):
        for coverage in dict.fromkeys(args.coverage):
            benches = [prepare(args, model_dir, device, batch_prompts, coverage,
                               prefetch == "on", dtype) for dtype in dtypes]
            if args.compare_hf and hf is None:
                progress("loading the checkpoint in transformers for generate()")
                hf = HfGenerate(model_dir, batch_prompts, args.gen_tokens, device)
            for i in range(args.repeat):  # the settings' rounds interleaved
                for b in benches:
                    timed_round(b, args, batch_prompts, hf, peer,
                                f"round {i + 1}/{args.repeat}" + (f" {b.dtype}"
                                                                  if len(benches) > 1 else ""))
            for b in benches:
                runs.append(summarize(b, args, model_dir))
                b.runner.close()
    if len(runs) == 1:
        out: dict[str, Any] = runs[0]
    else:
        out = {"runs": runs, "spill_penalty": spill_penalty(runs)}
        if len(dtypes) > 1:
            out["dtype_ratio"] = dtype_ratios(runs)
    if args.out is not None:
        progress(f"report: {write_report(args.out, out)['markdown']}")
    if args.json:
        print(json.dumps(out))
    else:
        print(render(out) if len(runs) == 1 else render_runs(out))
    return 0


def write_report(out_dir: Path, out: dict[str, Any]) -> dict[str, Any]:
    """engine.json, engine.md (a table of the runs, the spill penalty) and, for several runs,
    engine-spill.png under out_dir; returns the paths."""
    import matplotlib.pyplot as plt

    from services.bench.report import Report, table

    runs = out.get("runs", [out])
    r0 = runs[0]
    report = Report(out_dir, "engine", f"strata bench engine: {r0['model']} on "
                    f"{r0.get('device', 'cpu')}")
    report.text(f"- batch {r0['batch']}, {r0['prompt_tokens']} prompt + {r0['gen_tokens']} "
                f"generated tokens, policy {r0.get('policy', '-')}, placement "
                f"{r0.get('placement', '-')}, CUDA graphs {fmt_flag(r0.get('cuda_graphs'))}, "
                f"Triton expert kernel {fmt_flag(r0.get('device_kernel'))}\n"
                f"- bandwidth {r0['bandwidth_gb_s']:.1f} GB/s (median probe), active "
                f"{r0['active_bytes_per_token'] / 1e6:.1f} MB/token, bound "
                f"{r0['bandwidth_bound_tok_s']:.0f} tok/s\n")
    report.section("Runs", table(
        ["dtype", "prefetch", "coverage", "decode hit rate", "decode spill", "decode tok/s",
         "rounds tok/s", "prefill tok/s", "of the bound", "HF decode tok/s",
         "llama.cpp decode tok/s", "Strata / llama.cpp (decode, prefill)"],
        [[r.get("dtype", "fp32"), fmt_flag(r.get("prefetch")), f"{r['coverage']:.0%}",
          f"{r.get('decode_hit_rate', 1.0):.1%}", f"{r.get('decode_spill', 0.0):.1%}",
          r["decode_tok_s"], " / ".join(f"{x:.0f}" for x in r["decode_runs_tok_s"]),
          r["prefill_tok_s"], f"{r['bound_fraction']:.1%}", r.get("hf_decode_tok_s"),
          r.get("llama_decode_tok_s"),
          f"{r['llama_ratio']:.2f}x, {r['llama_prefill_ratio']:.2f}x"
          if "llama_ratio" in r else None]
         for r in runs]))
    for key, value in out.get("spill_penalty", {}).items():
        report.text(f"Spill penalty, {key.replace('_', ' ')}: "
                    + ("n/a (one spill level)" if value is None else
                       f"{value:.2f} tok/s per point of spill") + "\n")
    for key, value in out.get("dtype_ratio", {}).items():
        report.text(f"Decode {key}: {value:.2f}x (median of back-to-back rounds' ratios)\n")
    if out.get("dtype_ratio"):
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for r in runs:
            ax.plot(range(1, len(r["decode_runs_tok_s"]) + 1), r["decode_runs_tok_s"], "o-",
                    label=f"{r.get('dtype', 'fp32')}, {r['coverage']:.0%} coverage")
        ax.set(xlabel="round (the dtypes' rounds interleaved)", ylabel="decode tok/s",
               title="decode speed by weight dtype", ylim=(0, None))
        ax.legend()
        report.figure("dtype", fig, "decode tok/s per round, by weight dtype")
    if "llama_runs_tok_s" in r0:
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        rounds = range(1, len(r0["decode_runs_tok_s"]) + 1)
        ax.plot(rounds, r0["decode_runs_tok_s"], "o-", label="Strata")
        ax.plot(rounds, r0["llama_runs_tok_s"], "s--", label="llama.cpp, same file")
        ax.set(xlabel="round (the engines interleaved)", ylabel="decode tok/s",
               title=f"decode at batch {r0['batch']}: Strata {r0['llama_ratio']:.2f}x "
                     "llama.cpp", ylim=(0, None))
        ax.set_xticks(list(rounds))
        ax.legend()
        report.figure("peer", fig, "decode tok/s per round, Strata and llama.cpp")
    if len({r["decode_spill"] for r in runs}) > 1:
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for prefetch in dict.fromkeys(r.get("prefetch") for r in runs):
            pts = sorted((100 * r["decode_spill"], r["decode_tok_s"]) for r in runs
                         if r.get("prefetch") == prefetch)
            ax.plot([x for x, _ in pts], [y for _, y in pts], "o-",
                    label=f"prefetch {fmt_flag(prefetch)}")
        ax.set(xlabel="decode spill, % of routed experts served from outside the cache",
               ylabel="decode tok/s", title="decode speed vs spill", ylim=(0, None))
        ax.legend()
        report.figure("spill", fig, "decode tok/s against spill")
    return report.write(out)


def fmt_flag(value: bool | None) -> str:
    return "-" if value is None else "on" if value else "off"


@dataclass
class Bench:
    """One configuration under test: its runner, warmed up, and its timed rounds."""

    runner: Any
    dtype: str
    coverage: float
    prefetch: bool
    slots: int
    slot_bytes: int
    fixed: int  # non-expert bytes per decode step
    rounds: list[dict[str, Any]]


def prepare(args: argparse.Namespace, model_dir: Path, device: torch.device,
            batch_prompts: list[list[int]], coverage: float, prefetch: bool, dtype: str
            ) -> Bench:
    """Step 1 of the module docstring for one coverage, prefetch and dtype setting."""
    from services.engine.model.checkpoint import load_model_config
    from services.engine.runner import ModelRunner

    config = load_model_config(model_dir)
    slots = round(coverage * config.total_pairs)
    runner = ModelRunner(model_dir, device=str(device), cache_slots=slots, reserved_bytes=0,
                         prefetch=prefetch, expert_dtype=args.expert_dtype,
                         dtype=dtype, policy=PolicySpec(args.policy), placement=args.placement,
                         cuda_graphs=args.cuda_graphs == "on", cpu_kernels=args.cpu_kernels,
                         graph_batches=(args.batch,))
    runner.fill_cache(runner.layer_order_pairs(), source="layer order")
    on_cuda = device.type == "cuda"
    progress(f"{model_dir.name} on {device}: batch {args.batch}, {args.prompt_tokens} prompt + "
             f"{args.gen_tokens} generated tokens, {dtype_name(runner.weight_dtype)} weights, "
             f"{slots}/{config.total_pairs} pairs cached, policy "
             f"{args.policy}, prefetch {'on' if prefetch else 'off'}, "
             + (f"device kernel {'on' if runner.cache.device_kernel else 'off'}, CUDA graphs "
                f"{'on' if runner.graphs is not None else 'off'}" if on_cuda
                else f"{torch.get_num_threads()} threads, CPU kernels "
                     f"{'on' if runner.backend.cpu else 'off'}") + "; warm-up")
    run_strata(runner, batch_prompts, min(args.gen_tokens, 4))
    return Bench(runner, dtype, coverage, prefetch, slots, runner.slot_bytes,
                 runner.model.non_expert_bytes_per_step(), [])


def timed_round(b: Bench, args: argparse.Namespace, batch_prompts: list[list[int]],
                hf: HfGenerate | None, peer: Any, label: str) -> None:
    """Step 2 of the module docstring: one round of `b`, appended to b.rounds."""
    runner, c = b.runner, b.runner.config
    device = runner.device
    peak_rss.before_probe()
    read_bps, copy_bps = measure_bandwidth(device=device)
    peak_rss.after_probe()
    before = runner.cache.decode.copy()
    p_s, d_s, tokens, distinct = run_strata(runner, batch_prompts, args.gen_tokens)
    d = runner.cache.decode.since(before)
    active = (b.fixed + distinct * len(c.moe_layers) * b.slot_bytes) / args.batch
    r = {"read_bps": read_bps, "copy_bps": copy_bps, "prefill_s": p_s, "distinct": distinct,
         "decode_tok_s": args.batch * (args.gen_tokens - 1) / d_s,
         "spill": d.spilled / max(1, d.lookups), "hit_rate": d.hits / max(1, d.lookups)}
    r["bound_fraction"] = r["decode_tok_s"] / (read_bps / active)
    line = (f"{label}: bandwidth {read_bps / 1e9:.1f} GB/s, prefill "
            f"{p_s * 1e3:.0f} ms, decode {r['decode_tok_s']:.1f} tok/s "
            f"({r['bound_fraction']:.0%} of the bound), spill {r['spill']:.1%}")
    if hf is not None:
        hp, hd, hf_tokens = hf.run()
        r.update(hf_prefill_s=hp, hf_decode_tok_s=args.batch * (args.gen_tokens - 1) / hd,
                 hf_tokens_match=hf_tokens == tokens)
        r["hf_ratio"] = r["decode_tok_s"] / r["hf_decode_tok_s"]
        line += f"; HF decode {r['hf_decode_tok_s']:.1f} tok/s -> {r['hf_ratio']:.2f}x"
    if peer is not None:
        lc = peer.run()
        r.update(llama_prefill_tok_s=lc["prefill_tok_s"], llama_decode_tok_s=lc["decode_tok_s"],
                 llama_ratio=r["decode_tok_s"] / lc["decode_tok_s"],
                 llama_prefill_ratio=args.batch * args.prompt_tokens / p_s / lc["prefill_tok_s"])
        line += (f"; llama.cpp decode {lc['decode_tok_s']:.1f} tok/s -> {r['llama_ratio']:.2f}x,"
                 f" prefill {lc['prefill_tok_s']:.0f} tok/s -> {r['llama_prefill_ratio']:.2f}x")
    b.rounds.append(r)
    progress(line)


def summarize(b: Bench, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """Step 3 of the module docstring: the medians of b's rounds."""
    runner, rounds = b.runner, b.rounds
    total_pairs = runner.config.total_pairs

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    distinct = statistics.mean(r["distinct"] for r in rounds)
    active = (b.fixed + distinct * len(runner.config.moe_layers) * b.slot_bytes) / args.batch
    read_bps = median("read_bps")
    result: dict[str, Any] = {
        "model": model_dir.name,
        "device": str(runner.device),
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "threads": torch.get_num_threads(),
        "dtype": dtype_name(runner.weight_dtype),
        "cpu_kernels": runner.backend.cpu is not None,
        "device_kernel": runner.cache.device_kernel,
        "cuda_graphs": runner.graphs is not None,
        "coverage": b.slots / total_pairs if total_pairs else 1.0,
        "policy": args.policy,
        "placement": args.placement,
        "prefetch": b.prefetch,
        "expert_dtype": args.expert_dtype,
        "prefill_tok_s": args.batch * args.prompt_tokens / median("prefill_s"),
        "decode_tok_s": median("decode_tok_s"),
        "decode_runs_tok_s": [r["decode_tok_s"] for r in rounds],
        "decode_spill": statistics.mean(r["spill"] for r in rounds),
        "decode_hit_rate": statistics.mean(r["hit_rate"] for r in rounds),
        "bandwidth_gb_s": read_bps / 1e9,
        "bandwidth_runs_gb_s": [r["read_bps"] / 1e9 for r in rounds],
        "copy_bandwidth_gb_s": median("copy_bps") / 1e9,
        "non_expert_bytes_per_step": b.fixed,
        "expert_bytes": b.slot_bytes,
        "distinct_experts_per_layer_step": distinct,
        "active_bytes_per_token": active,
        "bandwidth_bound_tok_s": read_bps / active,
        "bound_fraction": median("bound_fraction"),
        "bound_fraction_runs": [r["bound_fraction"] for r in rounds],
        # every runner of this process (and transformers' model with --compare-hf), file-backed
        # pages of a memory-mapped checkpoint included; the bandwidth probes left out
        "peak_rss_bytes": peak_rss.value(),
        "peak_rss_includes_probes": peak_rss.includes_probes,
        "model_file_bytes": checkpoint_bytes(model_dir),
        "kv_bytes": runner.kv.nbytes,
    }
    if runner.device.type == "cuda":
        result["link_gb_s"] = runner.link.bytes_per_s / 1e9
    if "hf_decode_tok_s" in rounds[0]:
        result["hf_prefill_tok_s"] = args.batch * args.prompt_tokens / median("hf_prefill_s")
        result["hf_decode_tok_s"] = median("hf_decode_tok_s")
        result["hf_ratio"] = median("hf_ratio")
        result["hf_ratio_runs"] = [r["hf_ratio"] for r in rounds]
        result["hf_tokens_match"] = all(r["hf_tokens_match"] for r in rounds)
    if "llama_decode_tok_s" in rounds[0]:
        result["llama_decode_tok_s"] = median("llama_decode_tok_s")
        result["llama_prefill_tok_s"] = median("llama_prefill_tok_s")
        result["llama_ratio"] = median("llama_ratio")
        result["llama_prefill_ratio"] = median("llama_prefill_ratio")
        result["llama_ratio_runs"] = [r["llama_ratio"] for r in rounds]
        result["llama_runs_tok_s"] = [r["llama_decode_tok_s"] for r in rounds]
    return result


def dtype_ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Per (prefetch, coverage): each later dtype's decode tok/s over the first dtype's, the
    median of the ratios of rounds that ran back to back."""
    out = {}
    for prefetch, coverage in dict.fromkeys((r["prefetch"], r["coverage"]) for r in runs):
        group = [r for r in runs if (r["prefetch"], r["coverage"]) == (prefetch, coverage)]
        base = group[0]
        for r in group[1:]:
            ratios = [a / b for a, b in zip(r["decode_runs_tok_s"], base["decode_runs_tok_s"],
                                            strict=True)]
            out[f"{r['dtype']}/{base['dtype']} at {coverage:.0%}, prefetch "
                f"{'on' if prefetch else 'off'}"] = statistics.median(ratios)
    return out


def spill_penalty(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per prefetch setting: tok/s lost per point of decode spill (least-squares slope over
    its runs; None with fewer than two distinct spills)."""
    out: dict[str, float | None] = {}
    for prefetch in dict.fromkeys(r["prefetch"] for r in runs):
        pts = [(100 * r["decode_spill"], r["decode_tok_s"]) for r in runs
               if r["prefetch"] == prefetch]
        key = f"prefetch_{'on' if prefetch else 'off'}"
        if len({x for x, _ in pts}) < 2:
            out[key] = None
            continue
        mx = statistics.mean(x for x, _ in pts)
        my = statistics.mean(y for _, y in pts)
        slope = (sum((x - mx) * (y - my) for x, y in pts)
                 / sum((x - mx) ** 2 for x, _ in pts))
        out[key] = -slope
    return out


def render_runs(out: dict[str, Any]) -> str:
    runs = out["runs"]
    r0 = runs[0]
    lines = [f"model {r0['model']} on {r0['device']}: batch {r0['batch']}, {r0['prompt_tokens']}"
             f" prompt + {r0['gen_tokens']} generated tokens, policy {r0['policy']}, placement "
             f"{r0['placement']}",
             f"{'dtype':>5} {'prefetch':>8} {'coverage':>8} {'hit rate':>8} {'spill':>7} "
             f"{'decode tok/s':>12} {'prefill tok/s':>13} {'bound':>6}"]
    for r in runs:
        lines.append(f"{r.get('dtype', 'fp32'):>5} {'on' if r['prefetch'] else 'off':>8} "
                     f"{r['coverage']:>8.0%} "
                     f"{r['decode_hit_rate']:>8.1%} {r['decode_spill']:>7.1%} "
                     f"{r['decode_tok_s']:>12.1f} {r['prefill_tok_s']:>13.1f} "
                     f"{r['bound_fraction']:>6.0%}")
    for key, value in out["spill_penalty"].items():
        text = "n/a (one spill level)" if value is None else f"{value:.2f} tok/s per point"
        lines.append(f"spill penalty, {key.replace('_', ' ')}: {text}")
    for key, value in out.get("dtype_ratio", {}).items():
        lines.append(f"decode {key}: {value:.2f}x (median of back-to-back rounds)")
    return "\n".join(lines)


def render(r: dict[str, Any]) -> str:
    lines = [
        f"model {r['model']} on {r.get('device', 'cpu')}: batch {r['batch']}, {r['prompt_tokens']} prompt + "
        f"{r['gen_tokens']} generated tokens, {r['threads']} threads, coverage "
        f"{r['coverage']:.0%}, experts {r.get('expert_dtype', 'auto')}",
        f"prefill     {r['prefill_tok_s']:10.1f} tok/s",
        f"decode      {r['decode_tok_s']:10.1f} tok/s",
        f"active      {r['active_bytes_per_token'] / 1e6:10.1f} MB/token (non-expert "
        f"{r['non_expert_bytes_per_step'] / 1e6:.1f} MB/step + "
        f"{r['distinct_experts_per_layer_step']:.1f} distinct experts/layer/step x "
        f"{r['expert_bytes'] / 1e6:.2f} MB, over {r['batch']} token(s))",
        f"bandwidth   {r['bandwidth_gb_s']:10.1f} GB/s read (copy "
        f"{r['copy_bandwidth_gb_s']:.1f} GB/s)",
        f"bound       {r['bandwidth_bound_tok_s']:10.1f} tok/s -> decode at "
        f"{r['bound_fraction']:.0%} of the bandwidth bound (median of the rounds' ratios)",
    ]
    if r.get("model_file_bytes"):
        rss, kv, file = r["peak_rss_bytes"], r["kv_bytes"], r["model_file_bytes"]
        lines.append(f"memory      {rss / 2**30:10.2f} GiB peak RSS = {(rss - kv) / file:.2f}x "
                     f"the checkpoint's {file / 2**30:.2f} GiB + the KV pool's "
                     f"{kv / 2**30:.2f} GiB"
                     + (" (bandwidth probes included)" if r.get("peak_rss_includes_probes")
                        else ""))
    if "decode_spill" in r:
        lines.append(f"cache       {r['decode_hit_rate']:10.1%} decode hit rate, spill "
                     f"{r['decode_spill']:.1%}")
    if "hf_decode_tok_s" in r:
        lines.append(f"HF generate {r['hf_decode_tok_s']:10.1f} tok/s decode, "
                     f"{r['hf_prefill_tok_s']:.1f} tok/s prefill -> Strata {r['hf_ratio']:.2f}x"
                     f" (median of the rounds' ratios)"
                     f" (greedy tokens {'match' if r['hf_tokens_match'] else 'DIFFER'})")
    if "llama_decode_tok_s" in r:
        lines.append(f"llama.cpp   {r['llama_decode_tok_s']:10.1f} tok/s decode, "
                     f"{r['llama_prefill_tok_s']:.1f} tok/s prefill -> Strata decode "
                     f"{r['llama_ratio']:.2f}x, prefill {r['llama_prefill_ratio']:.2f}x (medians "
                     f"of the rounds' ratios: "
                     + " / ".join(f"{x:.2f}" for x in r["llama_ratio_runs"]) + ")")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
