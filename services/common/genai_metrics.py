"""Request metrics in the OpenTelemetry GenAI semantic conventions, for the gateway and engine.

    metrics = GenAIMetrics(meter, operation="chat")        # or "text_completion"
    metrics.record_request(model="qwen3-moe", duration_s=1.4, time_to_first_token_s=0.16,
                           input_tokens=26, output_tokens=192)
    metrics.set_load(running=3, waiting=1, kv_usage=0.42)  # read at each collection
    metrics.set_load_source(lambda: (engine.num_running, engine.num_waiting, None))  # or this

Instruments (GenAI semantic conventions, with their prescribed explicit bucket boundaries):

    gen_ai.server.request.duration (s)          histogram, every request (error.type on failure)
    gen_ai.server.time_to_first_token (s)       histogram, successful requests
    gen_ai.server.time_per_output_token (s)     histogram, successful requests with > 1 token:
                                                (duration - ttft) / (output tokens - 1)
    gen_ai.client.token.usage ({token})         histogram, gen_ai.token.type = input | output

and the load gauges routers and autoscalers read (vLLM's num_requests_running/waiting and
kv_cache_usage_perc are the same figures):

    strata.requests.running ({request})   strata.requests.waiting ({request})
    strata.kv_cache.usage (1)             share of KV cache blocks in use

Attributes: gen_ai.operation.name, gen_ai.provider.name ("strata"), gen_ai.request.model (left
out when unknown: a request refused before its body was read), error.type (failed requests only). Prometheus names: gen_ai_server_time_to_first_token_seconds,
gen_ai_client_token_usage (histograms: _bucket/_sum/_count), strata_requests_running, ...
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

PROVIDER = "strata"

# From the GenAI semantic conventions (gen-ai-metrics.md), "SHOULD be specified with
# ExplicitBucketBoundaries of ...".
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0)
TIME_PER_OUTPUT_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                 1.0, 2.5)
REQUEST_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                            20.48, 40.96, 81.92)
TOKEN_USAGE_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                       16777216, 67108864)


class GenAIMetrics:
    """The request instruments of one service (create one per meter)."""

    def __init__(self, meter: Meter, operation: str = "chat", provider: str = PROVIDER) -> None:
        self.operation = operation
        self.provider = provider
        self.request_duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="Generative AI server request duration such as time-to-last byte or "
                        "last output token",
            explicit_bucket_boundaries_advisory=REQUEST_DURATION_BUCKETS)
        self.time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="Time to generate first token for successful responses",
            explicit_bucket_boundaries_advisory=TIME_TO_FIRST_TOKEN_BUCKETS)
        self.time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Time per output token generated after the first token for successful "
                        "responses",
            explicit_bucket_boundaries_advisory=TIME_PER_OUTPUT_TOKEN_BUCKETS)
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="Number of input and output tokens used",
            explicit_bucket_boundaries_advisory=TOKEN_USAGE_BUCKETS)
        self._lock = threading.Lock()
        self._load: tuple[int, int, float | None] = (0, 0, None)
        self._load_source: Callable[[], tuple[int, int, float | None]] | None = None
        meter.create_observable_gauge("strata.requests.running", [self._observe(0)],
                                      unit="{request}", description="Requests being decoded")
        meter.create_observable_gauge("strata.requests.waiting", [self._observe(1)],
                                      unit="{request}", description="Requests waiting to start")
        meter.create_observable_gauge("strata.kv_cache.usage", [self._observe(2)], unit="1",
                                      description="Share of the KV cache in use")

    def attributes(self, model: str, operation: str | None = None,
                   error_type: str | None = None) -> dict[str, str]:
        out = {"gen_ai.operation.name": operation or self.operation,
               "gen_ai.provider.name": self.provider}
        if model:
            out["gen_ai.request.model"] = model
        if error_type:
            out["error.type"] = error_type
        return out

    def record_request(self, model: str, duration_s: float, *,
                       time_to_first_token_s: float | None = None, input_tokens: int = 0,
                       output_tokens: int = 0, error_type: str | None = None,
                       operation: str | None = None) -> None:
        """One finished request. A failed one (error_type set) records only its duration and
        the tokens used; the latency histograms are for successful responses."""
        attrs = self.attributes(model, operation, error_type)
        self.request_duration.record(duration_s, attrs)
        for token_type, count in (("input", input_tokens), ("output", output_tokens)):
            if count > 0:
                self.token_usage.record(count, attrs | {"gen_ai.token.type": token_type})
        if error_type or time_to_first_token_s is None:
            return
        self.time_to_first_token.record(time_to_first_token_s, attrs)
        if output_tokens > 1:
            per_token_s = max(0.0, duration_s - time_to_first_token_s) / (output_tokens - 1)
            self.time_per_output_token.record(per_token_s, attrs)

    def set_load(self, running: int, waiting: int, kv_usage: float | None = None) -> None:
        """The figures the load gauges report at the next collection."""
        with self._lock:
            self._load = (running, waiting, kv_usage)

    def set_load_source(self, source: Callable[[], tuple[int, int, float | None]]) -> None:
        """Read (running, waiting, kv_usage or None) from `source` at each collection instead
        (called on the collecting thread: it must only read plain figures)."""
        self._load_source = source

    def _observe(self, index: int):
        def observe(_: CallbackOptions) -> Iterable[Observation]:
            source = self._load_source
            if source is not None:
                value = source()[index]
                return [] if value is None else [Observation(value)]
            with self._lock:
                value = self._load[index]
            return [] if value is None else [Observation(value)]
        return observe
