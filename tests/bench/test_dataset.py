"""Pairing the two per-request engine log lines; bucket tables and Pearson r with known answers."""

from __future__ import annotations

import math

import pytest

from services.bench.dataset import bucket_table, pair_lines, parse_hit_line, summarize

PREFIX = "2026-01-01T00:00:00 INFO strata.serve: "


def prompt(tok_s: float, generated: int = 100) -> str:
    ms = generated / tok_s * 1e3
    return (f"{PREFIX}strata serve: prompt 26 tokens = 0 reused + 26 read in 43 ms, "
            f"{generated} generated in {ms:.0f} ms ({tok_s:.1f} tok/s)")


def hit(hits: int, lookups: int) -> str:
    spilled = lookups - hits
    return (f"{PREFIX}strata serve: decode expert cache hit rate: {100 * hits / lookups:.1f}% "
            f"({hits} hits / {lookups} lookups); {spilled} more served from host RAM "
            f"({100 * spilled / lookups:.2f}% of all {lookups} routed)")


def test_reference_lines_pair_including_the_draft_and_pcie_wording():
    lines = [
        "strata serve: prompt 26 tokens = 0 reused + 26 read in 43 ms, 192 generated in 1367 ms "
        "(140.5 tok/s), drafts accepted 123/192",
        "strata serve: decode expert cache hit rate: 86.3% (23414 hits / 27131 lookups); 412 "
        "more read by the GPU over PCIe or from another GPU (2.31% of all 17850 routed)",
    ]
    result = pair_lines(lines)
    assert not result.rejected
    (record,) = result.records
    assert (record.prompt_tokens, record.generated_tokens, record.decode_tok_s) == (26, 192, 140.5)
    assert record.drafts_accepted == 123
    assert record.hit_rate == pytest.approx(23414 / 27131)
    assert record.spill_ratio == pytest.approx(412 / 17850)


def test_the_engines_own_wording_pairs():
    lines = [prompt(100),
             "strata serve: decode expert cache hit rate: 90.0% (90 hits / 100 lookups); 10 more "
             "spilled, served by no cache slot (10.00% of all 100 routed); misses by placement: "
             "7 run from host memory, 3 copied over the link first"]
    (record,) = pair_lines(lines).records
    assert (record.hits, record.lookups) == (90, 100)
    assert record.spill_ratio == pytest.approx(0.1)


def test_clauses_appended_to_either_line_are_tolerated():
    lines = [prompt(100) + ", drafts accepted 50/100, queue 3 ms",
             hit(90, 100) + "; misses by placement: 10 from host memory, 0 copied over the link"]
    (record,) = pair_lines(lines).records
    assert record.drafts_accepted == 50 and record.hits == 90


def test_adjacent_lines_pair_and_other_log_lines_are_ignored():
    lines = ["INFO strata.engine: loading", prompt(100), hit(90, 100), "INFO other",
             prompt(50), hit(80, 100)]
    result = pair_lines(lines, "engine.log")
    assert [r.decode_tok_s for r in result.records] == [100.0, 50.0]
    assert [r.line for r in result.records] == [2, 5]
    assert not result.rejected


def test_non_adjacent_lines_are_rejected_not_paired():
    lines = [prompt(100), "INFO strata.engine: something in between", hit(90, 100),
             prompt(80), prompt(70), hit(70, 100), prompt(60)]
    result = pair_lines(lines)
    assert [r.decode_tok_s for r in result.records] == [70.0]
    reasons = [(r["line"], r["reason"]) for r in result.rejected]
    assert reasons == [
        (1, "prompt line not followed by its hit-rate line"),
        (3, "hit-rate line without a prompt line just before it"),
        (4, "prompt line not followed by its hit-rate line"),
        (7, "prompt line not followed by its hit-rate line"),
    ]


@pytest.mark.parametrize("bad", [
    "strata serve: prompt 26 tokens = 0 reused + 25 read in 43 ms, 9 generated in 10 ms (900.0 tok/s)",
    "strata serve: prompt 26 tokens, 9 generated",
    "strata serve: decode expert cache hit rate: 50.0% (60 hits / 50 lookups); 0 more x (0.00% of all 50 routed)",
    "strata serve: decode expert cache hit rate: 99.0% (50 hits / 100 lookups); 50 more x (50.00% of all 100 routed)",
    "strata serve: decode expert cache hit rate: lots",
])
def test_malformed_lines_are_rejected_and_break_the_pair(bad):
    result = pair_lines([prompt(100), bad, hit(90, 100)]) if "hit rate" in bad else (
        pair_lines([bad, hit(90, 100)]))
    assert not result.records
    assert any(r["reason"].startswith("malformed") for r in result.rejected)


def test_parse_hit_line_checks_the_percentage():
    assert parse_hit_line(hit(863, 1000))["hit_rate"] == pytest.approx(0.863)


def hand_made_log() -> list[str]:
    # (decode tok/s, hits): spill 0%, 0.6% (994 of 1000), 2%, 2%, 10%
    rows = [(200.0, 100), (120.0, 994), (100.0, 98), (110.0, 98), (50.0, 90)]
    lines = []
    for tok_s, hits in rows:
        lookups = 1000 if hits > 100 else 100
        lines += [prompt(tok_s), hit(hits, lookups)]
    return lines


def test_bucket_tables_and_pearson_known_answers():
    result = pair_lines(hand_made_log())
    assert len(result.records) == 5
    table = bucket_table(result.records, "spill_ratio", (0.0, 0.005, 0.01, 0.05, 0.2, 1.0))
    assert [row["count"] for row in table] == [1, 1, 2, 1, 0]
    assert [row["decode_p50_tok_s"] for row in table] == [200.0, 120.0, 105.0, 50.0, None]
    assert [row["share_of_best"] for row in table] == [1.0, 0.6, 0.525, 0.25, None]
    by_hit = bucket_table(result.records, "hit_rate", (0.0, 0.95, 0.99, 1.0))
    assert [row["count"] for row in by_hit] == [1, 2, 2]  # 1.0 lands in the last, closed bucket
    assert [row["decode_p50_tok_s"] for row in by_hit] == [50.0, 105.0, 160.0]

    summary = summarize(result)
    xs = [1.0, 0.994, 0.98, 0.98, 0.90]
    ys = [200.0, 120.0, 100.0, 110.0, 50.0]
    mx, my = sum(xs) / 5, sum(ys) / 5
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    expected = cov / math.sqrt(sum((x - mx) ** 2 for x in xs) * sum((y - my) ** 2 for y in ys))
    assert summary["pearson_r_hit_rate_decode"] == pytest.approx(expected)
    assert summary["pearson_r_spill_decode"] == pytest.approx(-expected)
    assert summary["num_requests"] == 5 and summary["num_rejected"] == 0


def test_requests_without_decode_steps_stay_in_the_dataset_but_out_of_the_tables():
    lines = [prompt(100), hit(90, 100),
             "strata serve: prompt 5 tokens = 0 reused + 5 read in 3 ms, 0 generated in 0 ms (0.0 tok/s)",
             "strata serve: decode expert cache hit rate: 0.0% (0 hits / 0 lookups); 0 more served "
             "from host RAM (0.00% of all 0 routed)"]
    summary = summarize(pair_lines(lines))
    assert summary["num_requests"] == 2 and summary["num_with_decode"] == 1
    assert sum(row["count"] for row in summary["by_hit_rate"]) == 1
