"""The expert cache: every (layer, expert) pair in a host store, a slot pool on the device holding
some of them, and the per-step lookup that runs each routed expert from its slot (hit), or from
the host store / a copy of it (miss).

    host_store   all pairs, one blob each (pinned on CUDA)     layout   the one blob layout
    slot_pool    S device slots + the pre-fill                  policy   Residency (pure): pinned
    expert_cache route / predict / apply per layer                       core + lru|lfu|crf region
    moe_compute  a layer's routed experts: C / Triton by address, torch per expert
    formats      what a blob is (fp32, bf16, int8, int4) and what may compute on it
    placement    link probe, expert timings, host-vs-copy       stats    counters (engine = replay)
    trace        routing traces (--record-routing)              replay   replay + Belady (MIN)
"""
