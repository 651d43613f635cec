"""W3C trace context: continue the caller's trace (or start one) and hand it to the engine.

The gateway is one hop of the trace: it keeps the incoming trace id (a new random one when the
request carries no valid `traceparent`), takes a fresh span id for itself, and sends
`traceparent` (and `tracestate`) to the engine in gRPC metadata. opentelemetry-api's propagator
does the parsing and formatting; no SDK is needed.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class TraceContext:
    span: SpanContext  # this gateway hop's span

    @property
    def trace_id(self) -> str:
        return f"{self.span.trace_id:032x}"

    def headers(self) -> dict[str, str]:
        """`traceparent` (+ `tracestate`) naming this hop as the parent of the next."""
        carrier: dict[str, str] = {}
        ctx = trace.set_span_in_context(NonRecordingSpan(self.span))
        _PROPAGATOR.inject(carrier, context=ctx)
        return carrier


def from_headers(headers: Mapping[str, str]) -> TraceContext:
    carrier = {k.lower(): v for k, v in headers.items() if k.lower() in _PROPAGATOR.fields}
    incoming = trace.get_current_span(_PROPAGATOR.extract(carrier)).get_span_context()
    if incoming.is_valid:
        trace_id, flags, state = incoming.trace_id, incoming.trace_flags, incoming.trace_state
    else:
        trace_id, flags, state = random.getrandbits(128) or 1, TraceFlags(TraceFlags.SAMPLED), None
    span = SpanContext(trace_id, random.getrandbits(64) or 1, is_remote=False, trace_flags=flags,
                       trace_state=state)
    return TraceContext(span)
