"""`strata bench engine`: in-process prefill and decode speed against the memory-bandwidth bound.

    strata bench engine [--model DIR] [--prompt-tokens P] [--gen-tokens G] [--batch B]
                        [--repeat R] [--coverage C] [--threads N] [--expert-dtype auto|int8|int4]
                        [--cpu-kernels auto|on|off] [--compare-hf] [--json]

1. Load the model with services.engine.runner.ModelRunner (expert cache at `--coverage`, all of
   it by default, filled in layer order) and, with `--compare-hf`, the same checkpoint in
   transformers; warm both up.
2. R timed rounds, each: the machine's memory read bandwidth (sum of a 256 MiB fp32 tensor, best
   of 3; copy bandwidth too), then Strata — `runner.step` driven directly: one batched prefill
   step of B prompts of P tokens, then G - 1 batched greedy decode steps (G tokens in all, like
   `generate(max_new_tokens=G)`) on fresh sequences — then transformers `generate()` (greedy,
   same prompts, same G, EOS off; decode tok/s = B * (G - 1) / (t(G) - t(1))). A shared VM's
   bandwidth drifts by 2x within minutes, so each round's decode is set against the bandwidth
   and the HF speed of the same round, and the medians of those per-round ratios are reported.
3. Active weight bytes per decode token: the non-expert weights the step reads (attention,
   norms, routers, dense MLPs, lm_head; the embedding row only) once per step, plus the distinct
   routed experts of every MoE layer (K per token at batch 1; at batch B the B*K routed pairs of a
   layer share experts, measured from the run), divided by the B tokens of the step. The bound is
   bandwidth / active bytes; decode's share of it is the headline figure.

Entry point: `main(argv) -> int`. With `--json` exactly one JSON object goes to stdout; progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from services.engine import kernels
from services.engine.model.quant import EXPERT_DTYPES

BANDWIDTH_BYTES = 256 * 2**20
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
    p.add_argument("--coverage", type=float, default=1.0, help="expert-cache slots as a "
                   "fraction of all (layer, expert) pairs")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default="auto", help="expert "
                   "weights in the host store and slots (int8/int4: quantized, as the engine's "
                   "--expert-dtype)")
    p.add_argument("--cpu-kernels", choices=kernels.MODES, default="auto", help="the engine's "
                   "C kernels for CPU decode (off: torch ops only, for comparison)")
    p.add_argument("--compare-hf", action="store_true", help="also time transformers generate()")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def progress(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def measure_bandwidth(num_bytes: int | None = None, repeats: int = BANDWIDTH_REPEATS
                      ) -> tuple[float, float]:
    """(read, copy) bandwidth in bytes/s, best of `repeats`: `x.sum()` reads num_bytes
    (BANDWIDTH_BYTES by default); `y.copy_(x)` reads and writes them (2 * num_bytes moved)."""
    num_bytes = num_bytes or BANDWIDTH_BYTES
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    read_s, copy_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        read_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        y.copy_(x)
        copy_s.append(time.perf_counter() - t0)
    return num_bytes / min(read_s), 2 * num_bytes / min(copy_s)


def non_expert_bytes(runner: Any) -> int:
    """Bytes of the non-expert weights one decode step reads (the embedding: one row/token)."""
    m = runner.model
    tensors = [m.final_norm, getattr(m, "lm_head", None), getattr(m, "lm_head_t", None)]
    for w in m.layers:  # every weight of the layer: attention, norms, router, dense MLP
        for value in vars(w).values():
            tensors += value if isinstance(value, tuple) else [value]
    total = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total + m.embed.shape[1] * m.embed.element_size()


def prompts(batch: int, num_tokens: int) -> list[list[int]]:
    """B distinct byte-token prompts of num_tokens each (ids < 256, valid in any byte vocab)."""
    data = TEXT.encode() * (1 + (num_tokens + batch * 7) // len(TEXT))
    return [list(data[7 * b : 7 * b + num_tokens]) for b in range(batch)]


def run_strata(runner: Any, batch_prompts: list[list[int]], gen_tokens: int
               ) -> tuple[float, float, list[list[int]], float]:
    """One batched prefill step and gen_tokens - 1 batched greedy decode steps on fresh
    sequences; (prefill_s, decode_s, generated ids per sequence, distinct experts per MoE layer
    per decode step)."""
    from services.engine.runner import ChunkWork

    seqs = [runner.start(p, max_num_tokens=len(p) + gen_tokens) for p in batch_prompts]
    for s in seqs:
        runner.blocks.append(s.table, s.num_tokens)
    chunks = [ChunkWork(s.token_ids, 0, s.table.block_ids, True, True) for s in seqs]
    t0 = time.perf_counter()
    results = runner.step(chunks)
    out = [[int(logits.argmax())] for logits, _ in results]
    prefill_s = time.perf_counter() - t0
    pairs0, steps0 = runner.cache.distinct_pairs_routed, runner.cache.layer_steps
    t0 = time.perf_counter()
    for _ in range(gen_tokens - 1):
        chunks = []
        for s, toks in zip(seqs, out, strict=True):
            s.token_ids.append(toks[-1])
            runner.blocks.append(s.table, s.num_tokens)
            chunks.append(ChunkWork([toks[-1]], s.num_tokens - 1, s.table.block_ids, False, True))
        for toks, (logits, _) in zip(out, runner.step(chunks), strict=True):
            toks.append(int(logits.argmax()))
    decode_s = time.perf_counter() - t0
    distinct = (runner.cache.distinct_pairs_routed - pairs0) / max(
        1, runner.cache.layer_steps - steps0)
    for s in seqs:
        runner.release(s)
    return prefill_s, decode_s, out, distinct


class HfGenerate:
    """transformers generate() on the same checkpoint and prompts, loaded once."""

    def __init__(self, model_dir: Path, batch_prompts: list[list[int]], gen_tokens: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # exactly G tokens, like Strata's loop
        self.ids = torch.tensor(batch_prompts)  # [B, P]
        self.gen_tokens = gen_tokens
        self._generate(min(gen_tokens, 4))  # warm-up

    def _generate(self, n: int) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(self.ids, max_new_tokens=n, min_new_tokens=n,
                                      attention_mask=torch.ones_like(self.ids), do_sample=False,
                                      pad_token_id=0)
        return time.perf_counter() - t0, out

    def run(self) -> tuple[float, float, list[list[int]]]:
        """(prefill_s, decode_s, generated ids per sequence) of one timed round."""
        t1, _ = self._generate(1)
        tg, out = self._generate(self.gen_tokens)
        return t1, max(tg - t1, 1e-9), out[:, self.ids.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.gen_tokens < 2 or args.prompt_tokens < 1 or args.batch < 1 or args.repeat < 1:
        raise SystemExit("--gen-tokens >= 2, --prompt-tokens, --batch, --repeat >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    from services.engine.runner import ModelRunner
    from services.models import default_model_dir

    kernels.configure(args.cpu_kernels)
    model_dir = args.model or default_model_dir()
    probe = ModelRunner(model_dir, device="cpu", device_memory_bytes=0, reserved_bytes=0,
                        expert_dtype=args.expert_dtype)
    slots = round(args.coverage * probe.total_pairs)
    slot_bytes, total_pairs = probe.slot_bytes, probe.total_pairs
    del probe
    runner = ModelRunner(model_dir, device="cpu", device_memory_bytes=slots * slot_bytes,
                         reserved_bytes=0, prefetch=False, expert_dtype=args.expert_dtype)
    runner.fill_cache(runner.layer_order_pairs(), source="layer order")
    c = runner.config
    batch_prompts = prompts(args.batch, args.prompt_tokens)
    progress(f"{model_dir.name}: batch {args.batch}, {args.prompt_tokens} prompt + "
             f"{args.gen_tokens} generated tokens, {slots}/{total_pairs} pairs cached, "
             f"{torch.get_num_threads()} threads, CPU kernels "
             f"{'on' if kernels.active() else 'off'}; warm-up")
    run_strata(runner, batch_prompts, min(args.gen_tokens, 4))
    hf = None
    if args.compare_hf:
        progress("loading the checkpoint in transformers for generate()")
        hf = HfGenerate(model_dir, batch_prompts, args.gen_tokens)
    fixed = non_expert_bytes(runner)
    rounds: list[dict[str, Any]] = []
    for i in range(args.repeat):
        read_bps, copy_bps = measure_bandwidth()
        p_s, d_s, tokens, distinct = run_strata(runner, batch_prompts, args.gen_tokens)
        active = (fixed + distinct * len(c.moe_layers) * slot_bytes) / args.batch
        r = {"read_bps": read_bps, "copy_bps": copy_bps, "prefill_s": p_s, "distinct": distinct,
             "decode_tok_s": args.batch * (args.gen_tokens - 1) / d_s}
        r["bound_fraction"] = r["decode_tok_s"] / (read_bps / active)
        line = (f"round {i + 1}/{args.repeat}: bandwidth {read_bps / 1e9:.1f} GB/s, prefill "
                f"{p_s * 1e3:.0f} ms, decode {r['decode_tok_s']:.1f} tok/s "
                f"({r['bound_fraction']:.0%} of the bound)")
        if hf is not None:
            hp, hd, hf_tokens = hf.run()
            r.update(hf_prefill_s=hp, hf_decode_tok_s=args.batch * (args.gen_tokens - 1) / hd,
                     hf_tokens_match=hf_tokens == tokens)
            r["hf_ratio"] = r["decode_tok_s"] / r["hf_decode_tok_s"]
            line += f"; HF decode {r['hf_decode_tok_s']:.1f} tok/s -> {r['hf_ratio']:.2f}x"
        rounds.append(r)
        progress(line)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    distinct = statistics.mean(r["distinct"] for r in rounds)
    active = (fixed + distinct * len(c.moe_layers) * slot_bytes) / args.batch
    read_bps = median("read_bps")
    result: dict[str, Any] = {
        "model": model_dir.name,
        "batch": args.batch,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "threads": torch.get_num_threads(),
        "cpu_kernels": kernels.active() is not None,
        "coverage": slots / total_pairs if total_pairs else 1.0,
        "expert_dtype": args.expert_dtype,
        "prefill_tok_s": args.batch * args.prompt_tokens / median("prefill_s"),
        "decode_tok_s": median("decode_tok_s"),
        "decode_runs_tok_s": [r["decode_tok_s"] for r in rounds],
        "bandwidth_gb_s": read_bps / 1e9,
        "bandwidth_runs_gb_s": [r["read_bps"] / 1e9 for r in rounds],
        "copy_bandwidth_gb_s": median("copy_bps") / 1e9,
        "non_expert_bytes_per_step": fixed,
        "expert_bytes": slot_bytes,
        "distinct_experts_per_layer_step": distinct,
        "active_bytes_per_token": active,
        "bandwidth_bound_tok_s": read_bps / active,
        "bound_fraction": median("bound_fraction"),
        "bound_fraction_runs": [r["bound_fraction"] for r in rounds],
    }
    if hf is not None:
        result["hf_prefill_tok_s"] = args.batch * args.prompt_tokens / median("hf_prefill_s")
        result["hf_decode_tok_s"] = median("hf_decode_tok_s")
        result["hf_ratio"] = median("hf_ratio")
        result["hf_ratio_runs"] = [r["hf_ratio"] for r in rounds]
        result["hf_tokens_match"] = all(r["hf_tokens_match"] for r in rounds)
    if args.json:
        print(json.dumps(result))
    else:
        print(render(result))
    return 0


def render(r: dict[str, Any]) -> str:
    lines = [
        f"model {r['model']}: batch {r['batch']}, {r['prompt_tokens']} prompt + "
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
    if "hf_decode_tok_s" in r:
        lines.append(f"HF generate {r['hf_decode_tok_s']:10.1f} tok/s decode, "
                     f"{r['hf_prefill_tok_s']:.1f} tok/s prefill -> Strata {r['hf_ratio']:.2f}x"
                     f" (median of the rounds' ratios)"
                     f" (greedy tokens {'match' if r['hf_tokens_match'] else 'DIFFER'})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
