"""What scoring a prompt costs (echo with logprobs: each prompt token's log-probability given
the ones before it), per prefill chunk, at real vocabulary sizes: the engine's one pass over the
chunk's logits rows (`Engine._score_prompt`: logsumexp, gather, topk over [T, V]) against the
row-at-a-time path a sampled token's logprobs take (`Engine._logprobs`: logsumexp and
`top_ids` on one row).

    PYTHONPATH=CHECKOUT python scripts/score_cost.py [--vocab 32000 151936] [--rows 110]
        [--top 1] [--rounds 5]

--rows defaults to a 64 MiB chunk of a 151936-token vocabulary (core.SCORE_LOGITS_BYTES).
Prints the median milliseconds a row for each, the two interleaved round by round.

With --url, end to end against a running gateway instead: a prompt of --prompt-chars
characters (new text each request, so no prefix is reused) with max_tokens 1, plain and with
echo and logprobs 1 (lm-evaluation-harness's loglikelihood request), alternating; prints the
median seconds of each and their ratio.

    python scripts/score_cost.py --url http://127.0.0.1:8000 [--prompt-chars 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from services.engine.sampling import top_ids


def row_at_a_time(rows: torch.Tensor, targets: torch.Tensor, k: int) -> None:
    for r in range(rows.shape[0]):
        x = rows[r].float()
        lse = torch.logsumexp(x, dim=-1)
        ids = top_ids(x, k)
        (x[ids] - lse).tolist()
        float(x[int(targets[r])] - lse)


def one_pass(rows: torch.Tensor, targets: torch.Tensor, k: int) -> None:
    x = rows.float()
    lse = torch.logsumexp(x, dim=-1)
    (x.gather(1, targets[:, None])[:, 0] - lse).tolist()
    values, ids = torch.topk(x, k, dim=-1)
    (values - lse[:, None]).tolist()
    ids.tolist()


def end_to_end(url: str, prompt_chars: int, rounds: int) -> None:
    import json
    import urllib.request

    from services.bench.prompts import text

    def post(path: str, body: dict) -> dict:
        request = urllib.request.Request(url.rstrip("/") + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as r:
            return json.loads(r.read())

    model = json.loads(urllib.request.urlopen(url.rstrip("/") + "/v1/models").read()
                       )["data"][0]["id"]
    times: dict[str, list[float]] = {"plain": [], "echo": []}
    tokens = 0
    for r in range(rounds):
        for i, (name, extra) in enumerate((("plain", {}), ("echo", {"echo": True,
                                                                     "logprobs": 1}))):
            started = time.perf_counter()
            reply = post("/v1/completions", {"model": model,
                                             "prompt": text(prompt_chars, seed=2 * r + i),
                                             "max_tokens": 1, "temperature": 0, **extra})
            times[name].append(time.perf_counter() - started)
            tokens = reply["usage"]["prompt_tokens"]
    plain, echo = statistics.median(times["plain"]), statistics.median(times["echo"])
    print(f"{model}, {tokens}-token prompts, {rounds} rounds: plain {plain:.3f} s, echo with "
          f"logprobs {echo:.3f} s ({echo / plain:.2f}x)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936])
    p.add_argument("--rows", type=int, default=110)
    p.add_argument("--top", type=int, default=1, help="alternatives a row (lm-eval asks 1)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--url", help="a running gateway: measure end to end instead")
    p.add_argument("--prompt-chars", type=int, default=2000)
    a = p.parse_args()
    if a.url:
        end_to_end(a.url, a.prompt_chars, a.rounds)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.rows} rows, "
          f"top {a.top}")
    print("| vocabulary | row at a time, ms a row | one pass, ms a row | ratio |")
    print("|---|---|---|---|")
    for vocab in a.vocab:
        rows = torch.randn(a.rows, vocab) * 3
        targets = torch.randint(0, vocab, (a.rows,))
        times: dict[str, list[float]] = {"row": [], "pass": []}
        for _ in range(a.rounds):
            for name, fn in (("row", row_at_a_time), ("pass", one_pass)):
                started = time.perf_counter()
                fn(rows, targets, a.top)
                times[name].append((time.perf_counter() - started) * 1e3 / a.rows)
        row, one = statistics.median(times["row"]), statistics.median(times["pass"])
        print(f"| {vocab} | {row:.3f} | {one:.3f} | {row / one:.2f}x |")


if __name__ == "__main__":
    main()
