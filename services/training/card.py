"""The model card (README.md) of a trained checkpoint, rendered from the run's summary dict."""

from __future__ import annotations

from typing import Any

from services.training.config import format_count, format_duration


def model_card(s: dict[str, Any]) -> str:
    r, c, t, h = s["recipe"], s["corpus"], s["train"], s["heldout"]
    lines = [
        f"# {s['name']}",
        "",
        "Strata's default model: a small `qwen3_moe` Mixture-of-Experts trained from scratch on the",
        "source of the Python standard library, by `strata model train-demo`. It writes",
        "Python-looking text; it is a test and benchmark model with learned routing, not an assistant.",
        "",
        "## Recipe",
        "",
        "| setting | value |",
        "|---|---|",
        f"| layers x experts, routed per token | {r['layers']} x {r['experts']}, top-{r['top_k']}"
        f" (norm_topk_prob={r['norm_topk_prob']}) |",
        f"| hidden, expert FFN, heads (q/kv x dim) | {r['hidden']}, {r['expert_ffn']}, "
        f"{s['shape']['num_heads']}/{s['shape']['num_kv_heads']} x {s['shape']['head_dim']} |",
        f"| context, vocabulary (byte-level BPE) | {r['context']}, {s['vocab_size']} |",
        f"| parameters (total / active per token) | {format_count(s['params']['total'])} / "
        f"{format_count(s['params']['active_per_token'])} |",
        f"| weights | {r['dtype']}, {s.get('checkpoint_bytes', 0) / 2**20:.1f} MiB |",
        f"| optimizer | AdamW (0.9, 0.95), lr {r['lr']:g}, warmup {r['warmup_steps']}, cosine to "
        f"{r['min_lr_ratio']:g}x, wd {r['weight_decay']:g}, clip {r['grad_clip']:g} |",
        f"| load-balancing loss | Switch-style E * sum f_e P_e, weight {r['aux_coef']:g} |",
        f"| batch x steps | {r['batch']} x {r['context']} tokens x {t['steps_done']} steps = "
        f"{format_count(t['tokens_seen'])} tokens"
        f"{' (stopped early by --max-minutes)' if t['stopped_early'] else ''} |",
        f"| seed, threads | {r['seed']}, {r['threads']} |",
        f"| training time | {format_duration(t['elapsed_s'])} at {t['tokens_per_s']:.0f} tokens/s |",
        "",
        "## Data",
        "",
        f"Python {c['python_version']} standard library (`{c['stdlib']}`): `.py` files, sorted,",
        "without test suites or site-packages. Whole top-level modules are held out:",
        "a module is held out iff `zlib.crc32(name) % 12 == 0`.",
        f"Train: {c['split']['train_files']} files ({format_count(c['train_tokens'])} tokens); "
        f"held out: {c['split']['heldout_files']} files "
        f"({format_count(c['heldout_tokens'])} tokens) from "
        f"{', '.join(c['split']['heldout_modules'])}.",
        "",
        "## Held-out results",
        "",
        f"On {format_count(h['num_tokens'])} held-out tokens: loss **{h['loss']:.4f}** nats/token, "
        f"perplexity **{h['perplexity']:.2f}**; a unigram model on the same tokenizer (add-one, "
        f"training counts) scores {h['unigram_loss']:.4f} (perplexity "
        f"{h['unigram_perplexity']:.2f}): ratio {h['perplexity_ratio']:.3f}.",
        "",
        "## Routing on held-out text",
        "",
        "Share of all routings covered by the hottest pairs: "
        + ", ".join(f"top {k} of pairs {v:.1%}" for k, v in s["routing"]["pair_top_share"].items())
        + ".",
        "",
        "| layer | load entropy (nats) | / log E | top 25% of experts | busiest expert |",
        "|---|---|---|---|---|",
    ]
    for x in s["routing"]["layers"]:
        lines.append(
            f"| {x['layer']} | {x['entropy']:.3f} | {x['entropy_ratio']:.3f} | "
            f"{x['top25_share']:.1%} | {x['max_share']:.1%} |"
        )
    lines += ["", "## Reproduce", "", "```", s["command"], "```", ""]
    return "\n".join(lines)
