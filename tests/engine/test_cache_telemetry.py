"""Cache telemetry per request (RequestStats, the second log line, the Finished proto) and
cumulative (the status RPC's CacheStatus)."""

from __future__ import annotations

import logging
import re
import threading

from services.common import counters
from services.engine.core import Engine
from services.engine.requests import EngineRequest, Finished, GenerateParams
from services.engine.sampling import SamplingConfig
from services.engine.server import StatusSource, stats_to_proto
from tests.engine.test_runner import runner_with_slots

E2E_LINE_2 = re.compile(r"strata serve: decode expert cache hit rate: [\d.]+% \((\d+) hits / "
                        r"(\d+) lookups\); (\d+) more spilled, served by no cache slot")


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
    s, d = first.stats, first.stats.decode
    assert s.lookups == s.hits + s.spilled > 0 and d.misses_host + d.misses_copied == s.spilled
    assert d.misses_host == s.spilled  # CPU, exact: the cost model keeps misses on the host
    assert d.predicted > 0 and 0 < d.prefetch_precision <= 1
    assert 0 < d.prefetch_recall <= 1 and s.prefill_lookups > 0
    msg = stats_to_proto(s)  # the same counters on the wire, field for field
    assert counters.from_proto(msg.decode) == d and counters.from_proto(msg.prefill) == s.prefill

    lines = [r.getMessage() for r in caplog.records if "decode expert cache" in r.getMessage()]
    assert len(lines) == 2
    hits, lookups, spilled = map(int, E2E_LINE_2.match(lines[0]).groups())
    assert (hits, lookups, spilled) == (s.hits, s.lookups, s.spilled)
    assert (f"misses by placement: {d.misses_host} run from host memory, 0 copied over the link "
            "first") in lines[0]
    assert "; prefetch precision " in lines[0] and "% recall " in lines[0]

    cache = StatusSource(engine, "e", "m", "cpu").status().cache
    assert (cache.policy, cache.pinned_slots, cache.dynamic_slots) == ("crf", 2, 4)
    assert cache.placement == "exact" and cache.prefetch and cache.link_gb_s > 0
    assert cache.host_expert_tokens_s > 0
    total = d.misses_host + second.stats.decode.misses_host
    lifetime = counters.from_proto(cache.decode)
    assert lifetime.misses_host == total and lifetime.misses_copied == 0
    assert lifetime.reasons == {"host:cheaper": sum(runner.cache.decode.reasons.values())}
    assert lifetime.lookups == s.lookups + second.stats.lookups
    assert 0 < lifetime.prefetch_precision <= 1 and lifetime.prefetch_fills >= 0
    assert lifetime == runner.cache.decode


def test_prefetch_predicts_nothing_once_every_pair_is_resident(tiny_dir):
    runner = runner_with_slots(tiny_dir, 24, placement="exact", prefetch=True)  # all 24 pairs
    runner.fill_cache(runner.layer_order_pairs())
    engine = Engine(runner)
    engine.start()
    try:
        d = serve_one(engine, "The expert cache").stats.decode
    finally:
        engine.stop()
    assert d.lookups == d.hits > 0  # every pair resident: nothing to prefetch, nor to predict
    assert d.predicted == 0 and d.prefetch_fills == 0
