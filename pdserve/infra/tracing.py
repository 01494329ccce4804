"""Traces (docs/TRACING.md): W3C trace context, one plain span type, and the OTLP export.

Every process records its spans as `Span` values (plain data, no OpenTelemetry object): the router
for its own stages, a node front for its request and, on behalf of its ranks, the ranks' records
(runtime/front/tracing.py). Spans carry explicit ids, so a span recorded on a rank can name a parent
that is exported later, by another process, or never. `Exporter` turns finished spans into
OpenTelemetry spans with their own start and end times and hands them to a BatchSpanProcessor; it
exists only when `--otlp-traces-endpoint` is given, and the OpenTelemetry SDK is imported only then.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("pdserve.tracing")

TRACEPARENT_MAX = 55  # "00-" 32 hex "-" 16 hex "-" 2 hex
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
ATTR_VALUE = (str, int, float, bool)


@dataclass(frozen=True)
class TraceContext:
    """Where a span hangs: its trace and its parent span (hex, as in a traceparent)."""

    trace_id: str
    span_id: str

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-01"


def parse_traceparent(value: object) -> TraceContext | None:
    """The context of a W3C `traceparent` header; None for anything else (W3C: an invalid header
    is ignored and a new trace starts)."""
    if type(value) is not str or len(value) > TRACEPARENT_MAX:
        return None
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or m.group(1) == "ff":
        return None
    trace_id, span_id = m.group(2), m.group(3)
    if trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceContext(trace_id, span_id)


def valid_traceparent(value: object) -> bool:
    return parse_traceparent(value) is not None


def new_trace_id() -> str:
    return os.urandom(16).hex()


def new_span_id() -> str:
    return os.urandom(8).hex()


@dataclass
class Span:
    """One finished (or, while recorded, open) span; times are Unix epoch nanoseconds."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    start_ns: int
    end_ns: int = 0
    service: str = ""  # router, prefill, decode
    attrs: dict[str, Any] = field(default_factory=dict)
    events: list[tuple[str, int]] = field(default_factory=list)  # (name, time ns)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "trace_id": self.trace_id,
            "span_id": self.span_id,
            "parent_id": self.parent_id,
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "service": self.service,
            "attrs": self.attrs,
            "events": [list(e) for e in self.events],
        }


class Exporter:
    """OTLP/HTTP export of finished spans through the SDK's BatchSpanProcessor (its own thread,
    so no caller ever waits on the collector)."""

    def __init__(self, endpoint: str, service: str):
        self._exporter = _otlp_exporter(endpoint)  # first: it says what to install when missing
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._processor = BatchSpanProcessor(self._exporter, schedule_delay_millis=500)
        self._resource = Resource.create({"service.name": f"pdserve-{service}"})
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self._scope = InstrumentationScope("pdserve")
        self.endpoint = endpoint

    def export(self, spans: list[Span]) -> None:
        for s in spans:
            self._processor.on_end(self._readable(s))

    def _readable(self, s: Span):
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

        tid = int(s.trace_id, 16)
        ctx = SpanContext(tid, int(s.span_id, 16), is_remote=False, trace_flags=TraceFlags(1))
        parent = (
            SpanContext(tid, int(s.parent_id, 16), is_remote=True, trace_flags=TraceFlags(1))
            if s.parent_id
            else None
        )
        return ReadableSpan(
            name=s.name,
            context=ctx,
            parent=parent,
            resource=self._resource,
            attributes={k: v for k, v in s.attrs.items() if isinstance(v, ATTR_VALUE)},
            events=tuple(Event(n, timestamp=t) for n, t in s.events),
            kind=SpanKind.SERVER if not s.parent_id else SpanKind.INTERNAL,
            start_time=s.start_ns,
            end_time=max(s.end_ns, s.start_ns),
            instrumentation_scope=self._scope,
        )

    def flush(self, timeout_ms: int = 5000) -> None:
        self._processor.force_flush(timeout_ms)

    def shutdown(self) -> None:
        self._processor.shutdown()


def _otlp_exporter(endpoint: str):
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise RuntimeError(
            "--otlp-traces-endpoint needs the OpenTelemetry SDK and its OTLP exporter: "
            "pip install 'pdserve[tracing]'"
        ) from None
    url = endpoint.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = f"http://{url}"
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    return OTLPSpanExporter(endpoint=url, timeout=10)


def make_exporter(endpoint: str | None, service: str) -> Exporter | None:
    """An exporter when tracing is on (`endpoint` given); None costs nothing."""
    if not endpoint:
        return None
    exp = Exporter(endpoint, service)
    log.info("tracing: exporting spans to %s", exp.endpoint)
    return exp
