"""The gateway's hop of a trace: one server span per HTTP request, its context sent to the engine.

The span continues the caller's W3C trace (`traceparent`/`tracestate` headers) or starts a new
trace, and is the parent of the engine's span: `TraceContext.metadata()` is the gRPC metadata
carrying it. Parsing and formatting are services.common.telemetry's (`extract_context`,
`inject_metadata`); spans export over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set (setup in
`__main__`), and otherwise are only ids that tie the gateway's and the engine's logs together.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer

from services.common.telemetry import extract_context, inject_metadata


@dataclass(frozen=True)
class TraceContext:
    span: Span  # this gateway hop's server span

    @property
    def trace_id(self) -> str:
        return f"{self.span.get_span_context().trace_id:032x}"

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """`traceparent` (+ `tracestate`) naming this hop as the parent of the next."""
        return tuple(inject_metadata(trace.set_span_in_context(self.span)))


def start_server_span(tracer: Tracer, method: str, route: str,
                      headers: Mapping[str, str]) -> Span:
    """The request's span (not ended: the caller ends it), child of the incoming trace if any."""
    parent = extract_context(headers.items())
    return tracer.start_span(f"{method} {route}", context=parent, kind=SpanKind.SERVER,
                             attributes={"http.request.method": method, "http.route": route})
