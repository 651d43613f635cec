"""Cache telemetry per request (RequestStats, the second log line, the Finished proto) and
cumulative (the status RPC's CacheStatus)."""

from __future__ import annotations

import logging
import re
import threading

from services.engine.core import Engine
from services.engine.requests import EngineRequest, Finished, GenerateParams
from services.engine.sampling import SamplingConfig
from services.engine.server import StatusSource, stats_to_proto
from tests.engine.test_runner import runner_with_slots

E2E_LINE_2 = re.compile(r"strata serve: decode expert cache hit rate: [\d.]+% \((\d+) hits / "
                        r"(\d+) lookups\); (\d+) more served from host RAM")


def serve_one(engine: Engine, prompt: str) -> Finished:
    done = threading.Event()
    events = []

    def sink(event):
        events.append(event)
        if isinstance(event, Finished):
            done.set()

    params = GenerateParams(max_tokens=16, sampling=SamplingConfig(temperature=0.8, seed=1))
    engine.submit(EngineRequest("r", params, prompt=prompt), sink)
    assert done.wait(30)
    return events[-1]


def test_request_stats_log_lines_and_status(tiny_dir, caplog):
    caplog.set_level(logging.INFO, logger="strata.serve")
    runner = runner_with_slots(tiny_dir, 6, placement="exact", prefetch=True)
    runner.fill_cache(runner.layer_order_pairs())
    engine = Engine(runner)
    engine.start()
    try:
        first = serve_one(engine, "The expert cache")
        second = serve_one(engine, "Another request entirely")
    finally:
        engine.stop()
    s = first.stats
    assert s.lookups == s.hits + s.spilled > 0 and s.misses_host + s.misses_copied == s.spilled
    assert s.misses_host == s.spilled  # CPU, exact: the cost model keeps misses on the host
    assert s.prefetch_predicted > 0 and 0 < s.prefetch_precision <= 1
    assert 0 < s.prefetch_recall <= 1 and s.prefill_lookups > 0
    msg = stats_to_proto(s)
    assert (msg.misses_host, msg.prefetch_predicted, msg.prefill_lookups) == (
        s.misses_host, s.prefetch_predicted, s.prefill_lookups)
    assert abs(msg.prefetch_recall - s.prefetch_recall) < 1e-9

    lines = [r.getMessage() for r in caplog.records if "decode expert cache" in r.getMessage()]
    assert len(lines) == 2
    hits, lookups, spilled = map(int, E2E_LINE_2.match(lines[0]).groups())
    assert (hits, lookups, spilled) == (s.hits, s.lookups, s.spilled)
    assert f"misses by placement: {s.misses_host} from host memory, 0 copied over the link" in lines[0]
    assert "; prefetch precision " in lines[0] and "% recall " in lines[0]

    cache = StatusSource(engine, "e", "m", "cpu").status().cache
    assert (cache.policy, cache.pinned_slots, cache.dynamic_slots) == ("crf", 2, 4)
    assert cache.placement == "exact" and cache.prefetch and cache.link_gb_s > 0
    assert cache.host_expert_tokens_s > 0
    total = s.misses_host + second.stats.misses_host
    assert cache.misses_host == total and cache.misses_copied == 0
    assert dict(cache.placement_reasons) == {"host:cheaper": sum(
        v for k, v in runner.cache.decode.reasons.items())}
    assert cache.lookups == s.lookups + second.stats.lookups
    assert 0 < cache.prefetch_precision <= 1 and cache.prefetch_fills >= 0
