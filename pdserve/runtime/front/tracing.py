"""A node front's traces (docs/TRACING.md): its request span, its ranks' records made into spans,
and the last requests' spans for `GET /debug/spans/{rid}` (the router's timeline reads it).

A request is traced when its /generate carries a `traceparent` header (the router sends one when
its tracing or timeline is on). The front opens `<role>.request` under it and hands the ranks a
traceparent naming that span (AddRequest.traceparent). The ranks' `SpanRecord`s come with their
stats pushes, every rank's, and become spans here: each gets an id derived from the request span's
id, its rank, name and sequence number, so a record can name its parent (`parent`) whether the
parent's record came before it, after it, or in another push. Spans go to the exporter when
`--otlp-traces-endpoint` is set; either way the last `keep` requests' spans stay for the debug
endpoint, bounded.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pdserve.infra.tracing import Exporter, Span, TraceContext, new_span_id, parse_traceparent
from pdserve.runtime.messages import SpanRecord
from pdserve.runtime.rank.spans import now_ns

log = logging.getLogger("pdserve.front")

KEEP_REQUESTS = 1000  # traced requests whose spans the front keeps for /debug/spans
SPANS_PER_REQUEST = 1024  # spans kept per request (the rest are still exported)


ENDS_WITHIN_S = 10.0  # after the last event, how long the request span waits for ranks' `finish`


@dataclass
class _Traced:
    span: Span  # the front's request span (open until every rank recorded its finish)
    spans: list[Span] = field(default_factory=list)  # finished: the front's and its ranks'
    finished_ranks: set[int] = field(default_factory=set)
    last_event_ns: int = 0  # when the ranks' last event reached the front (0: not yet)


def rank_span_id(request_span: str, pp_rank: int, name: str, seq: int) -> str:
    key = f"{request_span}/{pp_rank}/{name}/{seq}".encode()
    return hashlib.blake2b(key, digest_size=8).hexdigest()


class NodeTracing:
    def __init__(
        self,
        role: str,
        pp_size: int = 1,
        exporter: Exporter | None = None,
        keep: int = KEEP_REQUESTS,
    ):
        self.role, self.pp_size, self.exporter, self.keep = role, pp_size, exporter, keep
        self.requests: OrderedDict[str, _Traced] = OrderedDict()
        self.ending: dict[str, _Traced] = {}  # last event seen, some rank's finish not yet
        self.orphans = 0  # rank records of requests no longer kept

    def begin(self, rid: str, traceparent: str | None) -> str | None:
        """Opens the request span under the caller's context; the traceparent for the ranks, or
        None when the request is not traced (no header, or an invalid one)."""
        ctx = parse_traceparent(traceparent)
        if ctx is None:
            return None
        span = Span(
            f"{self.role}.request",
            ctx.trace_id,
            new_span_id(),
            ctx.span_id,
            now_ns(),
            service=self.role,
            attrs={"rid": rid},
        )
        self.requests[rid] = _Traced(span)
        while len(self.requests) > self.keep:
            self.requests.popitem(last=False)
        return TraceContext(ctx.trace_id, span.span_id).header()

    def trace_id(self, rid: str) -> str | None:
        t = self.requests.get(rid)
        return t.span.trace_id if t is not None else None

    def end(self, rid: str, outcome: str) -> None:
        """The ranks' last event for `rid` reached the front; the request span ends once every
        rank recorded its `finish` too (ranks further down the chain get there a little later),
        or ENDS_WITHIN_S after this."""
        t = self.requests.get(rid)
        if t is None or t.last_event_ns:
            return
        t.last_event_ns = now_ns()
        t.span.attrs["outcome"] = outcome
        self.ending[rid] = t
        self._maybe_close(rid, t)

    def _maybe_close(self, rid: str, t: _Traced, force: bool = False) -> None:
        if not t.last_event_ns or t.span.end_ns:
            return
        if force or len(t.finished_ranks) >= self.pp_size:
            ends = [s.end_ns for s in t.spans if s.parent_id == t.span.span_id]
            t.span.end_ns = max([t.last_event_ns, *ends])
            self.ending.pop(rid, None)
            self._emit(t, [t.span])

    def sweep(self) -> None:
        """Ends the request spans whose ranks' `finish` records never came."""
        limit = now_ns() - int(ENDS_WITHIN_S * 1e9)
        for rid, t in list(self.ending.items()):
            if t.last_event_ns < limit:
                self._maybe_close(rid, t, force=True)

    def ingest(self, pp_rank: int, records: list[SpanRecord]) -> None:
        """One rank's records, from its stats push."""
        for rec in records:
            t = self.requests.get(rec.rid)
            if t is None:
                self.orphans += 1
                continue
            req = t.span
            parent = (
                rank_span_id(req.span_id, pp_rank, rec.parent, 0) if rec.parent else req.span_id
            )
            span = Span(
                rec.name,
                req.trace_id,
                rank_span_id(req.span_id, pp_rank, rec.name, rec.seq),
                parent,
                rec.start_ns,
                rec.end_ns,
                service=self.role,
                attrs={**rec.attrs, "pp_rank": pp_rank, "rid": rec.rid},
                events=list(rec.events),
            )
            self._emit(t, [span])
            if rec.name.endswith(".finish"):
                t.finished_ranks.add(pp_rank)
                self._maybe_close(rec.rid, t)

    def spans(self, rid: str) -> list[dict[str, Any]] | None:
        """The request's spans so far (the request span, open or not, first); None: not kept."""
        t = self.requests.get(rid)
        if t is None:
            return None
        out = [] if t.span.end_ns else [t.span.to_json()]
        return out + [s.to_json() for s in t.spans]

    def _emit(self, t: _Traced, spans: list[Span]) -> None:
        room = SPANS_PER_REQUEST - len(t.spans)
        t.spans.extend(spans[: max(room, 0)])
        if self.exporter is not None:
            self.exporter.export(spans)

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.shutdown()
