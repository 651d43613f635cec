"""The telemetry dataset: each request's two engine log lines, paired, as one record.

    ... strata serve: prompt 26 tokens = 0 reused + 26 read in 43 ms, 192 generated in 1367 ms (140.5 tok/s)
    ... strata serve: decode expert cache hit rate: 86.3% (23414 hits / 27131 lookups); 3717 more ... (13.70% of all 27131 routed)

A pair is a prompt line immediately followed, on the very next line of the same file, by a
hit-rate line (as the reference paired them). Anything else is rejected and counted with a reason:
a prompt line whose next line is not a hit-rate line, a hit-rate line with no prompt line just
before it, and lines that carry the `strata serve:` marker but do not parse.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from services.bench.stats import median, pearson

MARKER = "strata serve: "
_PROMPT = re.compile(
    r"strata serve: prompt (\d+) tokens = (\d+) reused \+ (\d+) read in ([0-9.]+) ms, "
    r"(\d+) generated in ([0-9.]+) ms \(([0-9.]+|inf|nan) tok/s\)"
    r"(?:, drafts accepted (\d+)/(\d+))?(?:[,;] .*)?\s*$")
_HIT = re.compile(
    r"strata serve: decode expert cache hit rate: ([0-9.]+)% \((\d+) hits / (\d+) lookups\); "
    r"(\d+) more [^()]+ \(([0-9.]+)% of all (\d+) routed\)(?:[,;] .*)?\s*$")

# Reference buckets (design.md section 1) for spill; hit-rate buckets mirror them.
SPILL_EDGES = (0.0, 0.005, 0.01, 0.05, 0.20, 1.0)
HIT_EDGES = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)


@dataclass(frozen=True)
class RequestRecord:
    source: str
    line: int  # 1-based line number of the prompt line
    prompt_tokens: int
    reused_tokens: int
    prefill_ms: float
    generated_tokens: int
    decode_ms: float
    decode_tok_s: float
    hits: int
    lookups: int
    spilled: int
    routed: int
    hit_rate: float
    spill_ratio: float
    drafts_accepted: int | None = None

    @property
    def has_decode(self) -> bool:
        """Whether the request ran decode steps (a 1-token answer has no decode figures)."""
        return self.lookups > 0 and self.decode_tok_s > 0


@dataclass
class PairingResult:
    records: list[RequestRecord] = field(default_factory=list)
    rejected: list[dict] = field(default_factory=list)  # {"source", "line", "reason"}


def parse_prompt_line(text: str) -> dict | None:
    m = _PROMPT.search(text)
    if not m:
        return None
    prompt, reused, read = int(m[1]), int(m[2]), int(m[3])
    if reused + read != prompt:
        return None
    return {"prompt_tokens": prompt, "reused_tokens": reused, "prefill_ms": float(m[4]),
            "generated_tokens": int(m[5]), "decode_ms": float(m[6]),
            "decode_tok_s": float(m[7]),
            "drafts_accepted": int(m[8]) if m[8] is not None else None}


def parse_hit_line(text: str) -> dict | None:
    m = _HIT.search(text)
    if not m:
        return None
    hits, lookups, spilled, routed = int(m[2]), int(m[3]), int(m[4]), int(m[6])
    if hits > lookups or (lookups and abs(100 * hits / lookups - float(m[1])) > 0.051):
        return None
    return {"hits": hits, "lookups": lookups, "spilled": spilled, "routed": routed,
            "hit_rate": hits / lookups if lookups else 0.0,
            "spill_ratio": spilled / routed if routed else 0.0}


def pair_lines(lines: Iterable[str], source: str = "<log>") -> PairingResult:
    """Pair strictly adjacent prompt / hit-rate lines; everything else is rejected."""
    result = PairingResult()
    pending: tuple[int, dict] | None = None  # the prompt line just seen

    def reject(line_no: int, reason: str) -> None:
        result.rejected.append({"source": source, "line": line_no, "reason": reason})

    for line_no, text in enumerate(lines, start=1):
        prompt = hit = None
        if MARKER in text:
            if "strata serve: prompt " in text:
                prompt = parse_prompt_line(text)
                if prompt is None:
                    reject(line_no, "malformed prompt line")
            elif "strata serve: decode expert cache hit rate" in text:
                hit = parse_hit_line(text)
                if hit is None:
                    reject(line_no, "malformed hit-rate line")
        if pending is not None:
            prompt_line, fields = pending
            pending = None
            if hit is not None:
                result.records.append(RequestRecord(source=source, line=prompt_line, **fields,
                                                    **hit))
                continue
            reject(prompt_line, "prompt line not followed by its hit-rate line")
        elif hit is not None:
            reject(line_no, "hit-rate line without a prompt line just before it")
        if prompt is not None:
            pending = (line_no, prompt)
    if pending is not None:
        reject(pending[0], "prompt line not followed by its hit-rate line")
    return result


def _label(lo: float, hi: float) -> str:
    return f"{100 * lo:g}-{100 * hi:g}%"


def bucket_table(records: Sequence[RequestRecord], key: str, edges: Sequence[float]
                 ) -> list[dict]:
    """Rows per [lo, hi) bucket of `key` (the last bucket includes hi): count, decode p50 and
    share of best (this p50 / the highest bucket p50). Requests without decode are left out."""
    assert list(edges) == sorted(edges) and len(edges) >= 2
    rows = []
    for i, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        last = i == len(edges) - 2
        speeds = [r.decode_tok_s for r in records if r.has_decode
                  and lo <= getattr(r, key) and (getattr(r, key) < hi or
                                                  (last and getattr(r, key) <= hi))]
        rows.append({"bucket": _label(lo, hi), "lo": lo, "hi": hi, "count": len(speeds),
                     "decode_p50_tok_s": median(speeds)})
    best = max((r["decode_p50_tok_s"] for r in rows if r["decode_p50_tok_s"]), default=None)
    for row in rows:
        p50 = row["decode_p50_tok_s"]
        row["share_of_best"] = p50 / best if p50 is not None and best else None
    return rows


def summarize(result: PairingResult, spill_edges: Sequence[float] = SPILL_EDGES,
              hit_edges: Sequence[float] = HIT_EDGES) -> dict:
    """The dataset JSON: records, rejects, bucket tables, Pearson r (hit rate vs decode tok/s)."""
    decoded = [r for r in result.records if r.has_decode]
    hit_rates = [r.hit_rate for r in decoded]
    speeds = [r.decode_tok_s for r in decoded]
    reasons: dict[str, int] = {}
    for rej in result.rejected:
        reasons[rej["reason"]] = reasons.get(rej["reason"], 0) + 1
    return {
        "num_requests": len(result.records),
        "num_with_decode": len(decoded),
        "num_rejected": len(result.rejected),
        "rejected_by_reason": reasons,
        "pearson_r_hit_rate_decode": pearson(hit_rates, speeds),
        "pearson_r_spill_decode": pearson([r.spill_ratio for r in decoded], speeds),
        "by_spill_ratio": bucket_table(result.records, "spill_ratio", spill_edges),
        "by_hit_rate": bucket_table(result.records, "hit_rate", hit_edges),
        "records": [asdict(r) for r in result.records],
        "rejected": result.rejected,
    }
