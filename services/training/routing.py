"""`strata model routing`: routing statistics of a trained checkpoint on training and held-out text.

    strata model routing [--model DIR] [--tokens N] [--json]

Routing (the top-K experts of every token at every MoE layer) comes from Strata's own engine: a
`ModelRunner` loads the checkpoint, and each window of text runs as one prefill step of
`Decoder.forward` with a `RoutingTap` as its ExpertSource — the runner's expert cache, plus
a copy of each `route(layer, top_idx [T, K], counts)`. (A routing trace stores a step's experts
with their token counts, which loses which token took which expert inside a prefill step.)

Text: each split of the stdlib corpus (services.training.corpus: the fixed split by module) as
one id stream exactly as training builds it (files in corpus order, the checkpoint's
tokenizer.json, <|endoftext|> after each file), and from it N tokens as non-overlapping windows of
the context length spread evenly over the whole stream (not its first modules). "Train" is the
training split, not only the tokens an optimizer step saw. A test checks that the tap's routing
is the expert cache's, and per token what a routing trace records when the same tokens are
decoded one at a time.

Statistics (pure numpy over routing arrays [T, L, K] per window, L = MoE layers):
- load: share of all routings taken by the hottest 10/25/50% of (layer, expert) pairs, and per
  layer the load entropy (nats, and / log E) — evaluate.routing_stats, as the model card;
- consecutive reuse: per layer, the mean fraction of a token's K experts the previous token also
  used (K/E if routing were independent and uniform);
- reuse distance: for each routing, tokens since its (layer, expert) pair was last used in the
  window (a pair's first use in a window has none): p50/p90 and the shares within 1, 4, 16;
- train vs held-out: Jaccard overlap of the hottest-25% pair sets, Spearman rank correlation of
  pair counts, and the held-out hit rate of a static cache of the train-hottest 10/25/50% of pairs
  beside the held-out-hottest (the oracle's) of the same size; as a sampling-noise floor, the
  same overlap between the even and the odd held-out windows (half the tokens each, so if
  anything noisier than the comparison it calibrates).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from services.engine.model.step import ExpertSource
from services.training.bpe import split_ids
from services.training.evaluate import routing_stats
from services.training.loop import Log, stderr_log

if TYPE_CHECKING:
    from services.engine.runner import ModelRunner

DEFAULT_TOKENS = 32768  # per split: ~20 s in all for the default model on 2 cores
FRACTIONS = (0.10, 0.25, 0.50)
WITHIN = (1, 4, 16)


# -- statistics: pure numpy over routing windows [T, L, K] ----------------------------------------
def pair_counts(routes: Sequence[np.ndarray], num_experts: int) -> np.ndarray:
    """Routings per (layer, expert) pair [L, E] over all windows [T, L, K]."""
    L = routes[0].shape[1]
    counts = np.zeros((L, num_experts), dtype=np.int64)
    for r in routes:
        for layer in range(L):
            counts[layer] += np.bincount(r[:, layer].ravel(), minlength=num_experts)
    return counts


def consecutive_reuse(routes: Sequence[np.ndarray]) -> np.ndarray:
    """Per layer [L]: mean over tokens (not a window's first) of the fraction of the token's K
    experts that the previous token also used."""
    shared, tokens = None, 0
    for r in routes:  # [T, L, K]
        if len(r) < 2:
            continue
        prev, cur = r[:-1], r[1:]  # [T-1, L, K]
        hits = (cur[..., :, None] == prev[..., None, :]).any(-1)  # [T-1, L, K]
        s = hits.mean(-1).sum(0)  # [L]
        shared = s if shared is None else shared + s
        tokens += len(r) - 1
    assert shared is not None, "no window has two tokens"
    return shared / tokens


def reuse_distances(routes: Sequence[np.ndarray], num_experts: int) -> np.ndarray:
    """For every routing of every window, tokens since the same (layer, expert) pair was last
    used in that window (inf at a pair's first use in the window); flat float64."""
    out = []
    for r in routes:  # [T, L, K]
        T, L, K = r.shape
        used = np.zeros((T, L, num_experts), dtype=bool)
        used[np.arange(T)[:, None, None], np.arange(L)[None, :, None], r] = True
        pair, t = np.nonzero(used.reshape(T, L * num_experts).T)  # sorted by pair, then token
        d = np.full(len(t), np.inf)
        again = np.flatnonzero(pair[1:] == pair[:-1]) + 1
        d[again] = t[again] - t[again - 1]
        out.append(d)
    return np.concatenate(out)


def distance_summary(distances: np.ndarray) -> dict[str, Any]:
    """p50/p90 of the reuse distances (None where the quantile falls on first uses), the shares
    of all routings within 1, 4 and 16 tokens, and the share that are a pair's first use."""
    n = max(1, len(distances))
    out: dict[str, Any] = {}
    for q in (50, 90):
        v = float(np.quantile(distances, q / 100, method="inverted_cdf")) if len(distances) else 0
        out[f"p{q}"] = int(v) if math.isfinite(v) else None
    for w in WITHIN:
        out[f"within_{w}"] = float((distances <= w).sum() / n)
    out["first_use"] = float(np.isinf(distances).sum() / n)
    return out


def hottest(counts: np.ndarray, fraction: float) -> np.ndarray:
    """Flat indices of the hottest `fraction` of pairs (as many as routing_stats' top shares;
    ties broken by pair order)."""
    flat = counts.reshape(-1)
    n = max(1, round(flat.size * fraction))
    return np.argsort(-flat, kind="stable")[:n]


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    sa, sb = set(a.tolist()), set(b.tolist())
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 of x, ties sharing their mean rank."""
    ranks = np.empty(len(x))
    ranks[np.argsort(x, kind="stable")] = np.arange(len(x))
    _, tie, size = np.unique(x, return_inverse=True, return_counts=True)
    return (np.bincount(tie, weights=ranks) / size)[tie]


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
    """Spearman rank correlation (Pearson of average ranks); None if either side is constant."""
    rx, ry = average_ranks(np.ravel(x)), average_ranks(np.ravel(y))
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / denom) if denom else None


def static_hit_rate(profile: np.ndarray, counts: np.ndarray, fraction: float) -> float:
    """Share of `counts`' routings that a static cache of `profile`'s hottest pairs serves."""
    total = counts.sum()
    return float(counts.reshape(-1)[hottest(profile, fraction)].sum() / total) if total else 0.0


def split_stats(
    routes: Sequence[np.ndarray], num_experts: int, layer_ids: Sequence[int]
) -> dict[str, Any]:
    """Everything about one split's routing [T, L, K] windows (layer_ids: the MoE layers)."""
    counts = pair_counts(routes, num_experts)
    load = routing_stats(counts)
    reuse = consecutive_reuse(routes)
    layers = [
        {**asdict(lr), "layer": layer_ids[i], "consecutive_reuse": float(reuse[i])}
        for i, lr in enumerate(load.layers)
    ]
    return {
        "tokens": int(sum(len(r) for r in routes)),
        "windows": len(routes),
        "routings": int(counts.sum()),
        "pair_top_share": load.pair_top_share,
        "entropy_ratio_mean": float(np.mean([x["entropy_ratio"] for x in layers])),
        "consecutive_reuse": float(reuse.mean()),
        "reuse_distance": distance_summary(reuse_distances(routes, num_experts)),
        "layers": layers,
        "_counts": counts,
    }


def compare(train_counts: np.ndarray, heldout_counts: np.ndarray) -> dict[str, Any]:
    """Train vs held-out: overlap of the hottest-25% pair sets, rank correlation of pair counts,
    and held-out hit rates of static caches ranked by train (profile) and by held-out (oracle)."""
    return {
        "hot25_jaccard": jaccard(hottest(train_counts, 0.25), hottest(heldout_counts, 0.25)),
        "spearman": spearman(train_counts, heldout_counts),
        "static_hit_rate": {
            f"{round(f * 100)}%": {
                "train_profile": static_hit_rate(train_counts, heldout_counts, f),
                "oracle": static_hit_rate(heldout_counts, heldout_counts, f),
            }
            for f in FRACTIONS
        },
    }


# -- text and routing collection ------------------------------------------------------------------


def spread_windows(stream: np.ndarray, num_tokens: int, window: int) -> list[np.ndarray]:
    """num_tokens ids (fewer if the stream is shorter) as non-overlapping windows of `window`
    spread evenly over the stream, the first and last at its ends."""
    window = min(window, len(stream))
    count = max(1, min(num_tokens, len(stream)) // window)
    starts = np.linspace(0, len(stream) - window, count).round().astype(np.int64)
    return [stream[s : s + window] for s in starts]


class RoutingTap:
    """An ExpertSource that records every route() (top_idx [T, K] per layer) of a step and hands
    all calls on to `inner` (the runner's expert cache), which runs the experts."""

    def __init__(self, inner: ExpertSource, moe_layers: Sequence[int]):
        self.inner = inner
        self.row = {layer: i for i, layer in enumerate(moe_layers)}
        self.step: list[np.ndarray | None] = [None] * len(moe_layers)

    @property
    def wants_predictions(self) -> bool:
        return False  # next-layer predictions are not routing

    def route(self, layer: int, top_idx: torch.Tensor, counts: np.ndarray) -> None:
        self.step[self.row[layer]] = top_idx.numpy().copy()  # [T, K]
        self.inner.route(layer, top_idx, counts)

    def predict(self, layer: int, predicted: torch.Tensor) -> None:
        self.inner.predict(layer, predicted)

    def apply(self, layer: int, x: torch.Tensor, top_idx: torch.Tensor,
              top_w: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(layer, x, top_idx, top_w)

    def step_table(self) -> None:
        return None  # the tap's steps run layer by layer, through route()

    def finish_table_step(self, moe_layers: Sequence[int], top_idx: np.ndarray,
                          counts: np.ndarray) -> None:
        for layer, top in zip(moe_layers, top_idx, strict=True):
            self.step[self.row[layer]] = top.copy()
        self.inner.finish_table_step(moe_layers, top_idx, counts)

    def take(self) -> np.ndarray:
        """The last step's routing [T, L, K]."""
        assert all(s is not None for s in self.step), "a MoE layer did not route"
        out = np.stack(self.step, axis=1)  # type: ignore[arg-type]
        self.step = [None] * len(self.step)
        return out


def route_windows(runner: ModelRunner, windows: Sequence[np.ndarray]) -> Iterator[np.ndarray]:
    """Routing [T, L, K] of each window, run as one prefill step of the runner's model."""
    from services.engine.driver import SequenceDriver

    tap = RoutingTap(runner.cache, runner.config.moe_layers)
    drive = SequenceDriver(runner)
    try:
        for ids in windows:
            seq = drive.start(ids.tolist())
            try:
                drive.run([(seq, seq.num_tokens)], experts=tap)
            finally:
                drive.release(seq)
            yield tap.take()
    finally:
        drive.close()


def routing_report(
    model_dir: Path,
    num_tokens: int,
    log: Log | None = None,
    root: Path | None = None,
    max_bytes: int | None = None,
    threads: int = 1,
) -> dict[str, Any]:
    """Collect both splits' routing with the engine and compute every statistic."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _report(Path(model_dir), num_tokens, log or (lambda line: None), root, max_bytes)
    finally:
        torch.set_num_threads(threads_before)


def _report(
    model_dir: Path, num_tokens: int, log: Log, root: Path | None, max_bytes: int | None
) -> dict[str, Any]:
    from services.engine.runner import ModelRunner

    t_start = time.perf_counter()
    runner = ModelRunner(model_dir, device="cpu", cache_slots=0, reserved_bytes=0)
    c = runner.config
    log(
        f"routing: {runner.model_name} ({len(c.moe_layers)} MoE layers x {c.num_experts} "
        f"experts, top-{c.experts_per_token}), {num_tokens} tokens per split in windows of "
        f"up to {c.context_window}"
    )
    splits, counts, halves = {}, {}, None
    for split in ("train", "heldout"):
        t0 = time.perf_counter()
        stream = split_ids(split, model_dir / "tokenizer.json", root, max_bytes)
        windows = spread_windows(stream, num_tokens, c.context_window)
        log(
            f"routing: {split}: {len(windows)} windows of {len(windows[0])} over "
            f"{len(stream)} tokens ({time.perf_counter() - t0:.1f} s to tokenize)"
        )
        routes = []
        for i, r in enumerate(route_windows(runner, windows)):
            routes.append(r)
            if (i + 1) % 8 == 0 or i + 1 == len(windows):
                log(
                    f"routing: {split}: {i + 1}/{len(windows)} windows routed "
                    f"({time.perf_counter() - t0:.1f} s)"
                )
        stats = split_stats(routes, c.num_experts, c.moe_layers)
        counts[split] = stats.pop("_counts")
        if split == "heldout" and len(routes) > 1:  # sampling noise: alternate windows
            halves = [pair_counts(routes[i::2], c.num_experts) for i in (0, 1)]
        splits[split] = {"stream_tokens": len(stream), **stats}
    runner.close()
    return {
        "model": str(model_dir),
        "fingerprint": runner.fingerprint,
        "moe_layers": len(c.moe_layers),
        "num_experts": c.num_experts,
        "experts_per_token": c.experts_per_token,
        "total_pairs": c.total_pairs,
        "window_tokens": len(routes[0]),
        "uniform_reuse": c.experts_per_token / c.num_experts,
        "train": splits["train"],
        "heldout": splits["heldout"],
        "overlap": compare(counts["train"], counts["heldout"]),
        "heldout_halves": None if halves is None else compare(*halves),
        "elapsed_s": round(time.perf_counter() - t_start, 2),
    }


# -- the command ----------------------------------------------------------------------------------
def _pct(x: float) -> str:
    return f"{x:.1%}"


def format_report(r: dict[str, Any]) -> str:
    tr, ho, ov = r["train"], r["heldout"], r["overlap"]
    lines = [
        f"{r['model']}: {r['moe_layers']} MoE layers x {r['num_experts']} experts, "
        f"top-{r['experts_per_token']}; {tr['tokens']} train / {ho['tokens']} held-out tokens "
        f"in windows of {r['window_tokens']}",
        "",
        "         ---------- train ----------   -------- held-out ---------",
        "layer    H nats  H/lnE  top25  reuse     H nats  H/lnE  top25  reuse",
    ]
    for a, b in zip(tr["layers"], ho["layers"], strict=True):
        lines.append(
            f"{a['layer']:>5}  "
            + "   ".join(
                f"{x['entropy']:>7.3f} {x['entropy_ratio']:>6.3f} {x['top25_share']:>6.1%} "
                f"{x['consecutive_reuse']:>6.1%}"
                for x in (a, b)
            )
        )
    lines.append("(H: the layer's expert-load entropy; top25: share of its busiest 25% of experts;")
    lines.append(" reuse: share of a token's experts the previous token also used)")
    lines.append("")
    for name, s in (("train", tr), ("held-out", ho)):
        share = s["pair_top_share"]
        d = s["reuse_distance"]
        p90 = "-" if d["p90"] is None else d["p90"]
        lines.append(
            f"{name:<9} hottest 10/25/50% of pairs take {_pct(share['10%'])} / "
            f"{_pct(share['25%'])} / {_pct(share['50%'])} of routings; mean H/lnE "
            f"{s['entropy_ratio_mean']:.3f}; consecutive reuse {_pct(s['consecutive_reuse'])} "
            f"(independent uniform: {_pct(r['uniform_reuse'])})"
        )
        lines.append(
            f"{'':<9} reuse distance p50 {d['p50']} / p90 {p90} tokens; within 1/4/16 tokens "
            f"{_pct(d['within_1'])} / {_pct(d['within_4'])} / {_pct(d['within_16'])}; "
            f"first use in window {_pct(d['first_use'])}"
        )
    rho = "n/a" if ov["spearman"] is None else f"{ov['spearman']:.3f}"
    hits = "; ".join(
        f"{k} {_pct(v['train_profile'])} (oracle {_pct(v['oracle'])})"
        for k, v in ov["static_hit_rate"].items()
    )
    lines.append(
        f"train vs held-out: hottest-25% sets Jaccard {ov['hot25_jaccard']:.3f}; Spearman of "
        f"pair counts {rho}"
    )
    lines.append(f"held-out hit rate of a static cache of the train-hottest pairs: {hits}")
    halves = r["heldout_halves"]
    if halves is not None:
        rho = "n/a" if halves["spearman"] is None else f"{halves['spearman']:.3f}"
        lines.append(
            f"sampling noise (held-out even vs odd windows, half the tokens each): Jaccard "
            f"{halves['hot25_jaccard']:.3f}; Spearman {rho}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from services.models import default_model_dir

    parser = argparse.ArgumentParser(
        prog="strata model routing",
        description="Routing statistics of a trained checkpoint on the training and held-out "
        "splits of the stdlib corpus: load concentration, per-layer entropy, reuse between "
        "tokens, and train vs held-out overlap. Progress on stderr.",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint directory (default: the shipped strata-stdlib-moe)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=DEFAULT_TOKENS,
        help=f"tokens routed per split (default {DEFAULT_TOKENS})",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: the model's matrices are small)",
    )
    parser.add_argument(
        "--corpus-max-bytes",
        type=int,
        default=None,
        help="read at most this much text per split (quick runs and tests)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for flag in ("tokens", "threads", "corpus_max_bytes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    model_dir = args.model or default_model_dir()
    if not (model_dir / "config.json").is_file():
        print(
            f"strata model routing: no checkpoint at {model_dir} (config.json missing)",
            file=sys.stderr,
        )
        return 1
    report = routing_report(
        model_dir,
        args.tokens,
        log=stderr_log,
        max_bytes=args.corpus_max_bytes,
        threads=args.threads,
    )
    print(json.dumps(report) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
