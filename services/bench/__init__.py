"""Benchmarks and the capacity planner: the numbers an operator plans with.

    strata bench run|sweep|soak|overload|longctx  --HTTP--> a running gateway
         │ per-request outcomes (client TTFT, engine figures)      ResourceSampler (every 2 s)
         v                                                          │
    result JSON ──> report (Markdown + PNG) <───────────────────────┘
    strata bench dataset LOGS   engine log lines -> paired dataset, bucket tables, Pearson r
    strata plan fit RESULTS     result JSONs -> cost model (decode s/token vs miss rate) + error
    strata plan                 memory -> slots -> coverage -> hit rate -> decode tok/s (+ inverse)

Core modules (stats, dataset, planner) are pure Python + numpy; only client.py speaks HTTP.
"""
