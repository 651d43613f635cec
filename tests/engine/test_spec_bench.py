"""`strata bench spec` on the tiny checkpoint: one JSON object, outputs equal at every K."""

from __future__ import annotations

import json

from services.bench.spec_bench import main, render


def test_bench_spec_reports_speed_reads_and_acceptance_per_k(tiny_dir, capsys):
    code = main(
        [
            "--model",
            str(tiny_dir),
            "--gen-tokens",
            "12",
            "--repeat",
            "1",
            "--spec-tokens",
            "0",
            "3",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert set(out["sets"]) == {"edit", "free"}
    for rows in out["sets"].values():
        off, on = rows
        assert (off["spec_tokens"], on["spec_tokens"]) == (0, 3)
        assert off["drafts_proposed"] == 0 and off["tokens_per_step"] == 1.0
        assert on["same_output"] and on["decode_tokens"] == off["decode_tokens"]
        assert on["tokens_per_step"] >= 1.0 and on["decode_steps"] <= off["decode_steps"]
        assert (
            on["expert_reads_per_token"] > 0 and on["lookups_per_token"] >= off["lookups_per_token"]
        )
    assert "| edit | 3 |" in render(out)
