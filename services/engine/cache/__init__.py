"""The expert cache: every (layer, expert) pair in a host store, a slot pool on the device holding
some of them, and the per-step lookup that runs each routed expert from its slot (hit), or from
the host store / a copy of it (miss).

    host_store   all pairs, one blob each (pinned on CUDA)     layout   the one blob layout
    slot_pool    S device slots + the pre-fill                  policy   Residency (pure): pinned
    expert_cache route / predict / expert_forward per layer              core + lru|lfu|crf region
    placement    link probe, expert timings, host-vs-copy       stats    counters (engine = replay)
    trace        routing traces (--record-routing)              replay   replay + Belady (MIN)
"""
