"""The router's side of tracing (docs/TRACING.md): one `RequestTrace` per generation request, the
timeline of the last N requests, and `GET /debug/requests[/{id}]` (internal token).

A trace starts in `Router.serve`: under the client's `traceparent` when it sent a valid one, else a
new trace. It is the context variable `CURRENT` for the handler and the tasks it starts, so the
admission queue (`Router.admit`) and each attempt (router/routing/attempt.py) add their spans to it
without being handed it. An attempt sends both nodes a `traceparent` naming its span; the nodes hang
their spans (front and ranks) under it. When the request ends, the router's spans are exported (with
`--otlp-traces-endpoint`) and the trace joins the timeline ring. `/debug/requests/{id}` merges them
with the nodes' spans, which it reads from each node's `/debug/spans/{rid}` on demand.

Off (no endpoint and `--debug-requests 0`): no trace, no header, no span, nothing recorded.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.infra.logs import bind_request
from pdserve.infra.tracing import Exporter, Span, TraceContext, new_span_id, new_trace_id
from pdserve.infra.tracing import parse_traceparent as parse
from pdserve.router.errors import ApiError

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")

CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "pdserve_request_trace", default=None
)
TRACED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
NODE_FETCH_TIMEOUT_S = 5.0


def now_ns() -> int:
    return time.time_ns()


class RequestTrace:
    """One request's spans at the router: `router.request` (root, or under the client's span),
    `router.admission_queue`, and one `router.attempt` per try with a `first_token` event."""

    def __init__(self, route: str, traceparent: str | None):
        ctx = parse(traceparent)
        self.root = Span(
            "router.request",
            ctx.trace_id if ctx else new_trace_id(),
            new_span_id(),
            ctx.span_id if ctx else "",
            now_ns(),
            service="router",
            attrs={"route": route},
        )
        self.spans: list[Span] = []  # finished, besides the root
        self.attempts: dict[str, Span] = {}  # rid -> open attempt span
        self.nodes: list[tuple[str, str, str]] = []  # (role, node url, rid) of every attempt

    @property
    def trace_id(self) -> str:
        return self.root.trace_id

    def add(self, name: str, start_ns: int, end_ns: int, **attrs) -> None:
        self.spans.append(
            Span(name, self.trace_id, new_span_id(), self.root.span_id, start_ns, end_ns,
                 service="router", attrs=attrs)
        )  # fmt: skip

    def attempt_start(self, rid: str, nodes: list[tuple[str, str]], route: Any = None) -> str:
        """Opens the attempt's span; the traceparent both nodes get. The route's path, the reason
        for it and its predicted TTFT (router/routing/attempt.py `Route`) go on the span."""
        attrs: dict[str, Any] = {"rid": rid}
        if route is not None:
            attrs.update(path=route.path, reason=route.reason)
            if route.predicted_ttft_s is not None:
                attrs["predicted_ttft_ms"] = round(route.predicted_ttft_s * 1e3, 1)
        span = Span("router.attempt", self.trace_id, new_span_id(), self.root.span_id, now_ns(),
                    service="router", attrs=attrs)  # fmt: skip
        for role, url in nodes:
            span.attrs[f"{role}_node"] = url
            self.nodes.append((role, url, rid))
        self.attempts[rid] = span
        self.root.attrs["rid"] = rid
        return TraceContext(self.trace_id, span.span_id).header()

    def first_token(self, rid: str) -> None:
        span = self.attempts.get(rid)
        if span is not None:
            span.events.append(("first_token", now_ns()))

    def migrated(self, rid: str, cause: str, tokens: int) -> None:
        """The stream moved to attempt `rid` (router/routing/migration.py): an event on it."""
        span = self.attempts.get(rid)
        if span is not None:
            span.attrs.update(migrated_from_cause=cause, resumed_tokens=tokens)
            span.events.append(("migrated", now_ns()))

    def attempt_end(self, rid: str, ok: bool | None, finish_reason: str | None) -> None:
        span = self.attempts.pop(rid, None)
        if span is None:
            return
        span.end_ns = now_ns()
        span.attrs["outcome"] = {True: "ok", False: "failed", None: "given_up"}[ok]
        if finish_reason:
            span.attrs["finish_reason"] = self.root.attrs["finish_reason"] = finish_reason
        self.spans.append(span)

    def finish(self, status: int) -> list[Span]:
        """The request is over at the router; its spans (attempts still open end here)."""
        for rid in list(self.attempts):
            self.attempt_end(rid, None, None)
        self.root.end_ns = now_ns()
        self.root.attrs["http_status"] = status
        return [self.root, *self.spans]

    def summary(self) -> dict[str, Any]:
        r = self.root
        return {
            "id": self.trace_id,
            "rid": r.attrs.get("rid"),
            "route": r.attrs["route"],
            "start_ns": r.start_ns,
            "duration_ms": round((r.end_ns - r.start_ns) / 1e6, 3),
            "status": r.attrs.get("http_status"),
            "finish_reason": r.attrs.get("finish_reason"),
        }


class Timeline:
    """The last `keep` finished requests' traces, and the exporter (None: tracing is off)."""

    def __init__(self, keep: int, exporter: Exporter | None):
        self.keep, self.exporter = keep, exporter
        self.traces: OrderedDict[str, RequestTrace] = OrderedDict()  # trace id -> trace
        self.by_rid: dict[str, str] = {}  # attempt rid -> trace id

    @property
    def enabled(self) -> bool:
        return self.keep > 0 or self.exporter is not None

    def start(self, route: str, request: Request) -> RequestTrace | None:
        """A trace for a generation request, the current one from here on; None when off."""
        if route not in TRACED_ROUTES or not self.enabled:
            return None
        trace = RequestTrace(route, request.headers.get("traceparent"))
        CURRENT.set(trace)
        bind_request(None, trace.trace_id)  # JSON log lines of this request carry its trace id
        return trace

    def end(self, trace: RequestTrace, status: int) -> None:
        spans = trace.finish(status)
        if self.exporter is not None:
            self.exporter.export(spans)
        if self.keep <= 0:
            return
        # A client may send one traceparent with many requests: the newest keeps the trace id,
        # and the one it replaces takes its attempts' rids along, or they would pile up forever
        self._forget(self.traces.pop(trace.trace_id, None))
        self.traces[trace.trace_id] = trace
        for _, _, rid in trace.nodes:
            self.by_rid[rid] = trace.trace_id
        while len(self.traces) > self.keep:
            self._forget(self.traces.popitem(last=False)[1])

    def _forget(self, old: RequestTrace | None) -> None:
        for _, _, rid in old.nodes if old is not None else ():
            if self.by_rid.get(rid) == old.trace_id:
                del self.by_rid[rid]

    def find(self, ident: str) -> RequestTrace | None:
        """By trace id, attempt rid, or the response id a client saw (chatcmpl-RID, cmpl-RID)."""
        rid = ident.split("-", 1)[1] if ident.startswith(("chatcmpl-", "cmpl-")) else ident
        return self.traces.get(ident) or self.traces.get(self.by_rid.get(rid, ""))

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.shutdown()


# --- GET /debug/requests[/{id}]: handler(router, request, t0), run by Router.serve ------------
async def list_requests(router, request: Request, t0: float) -> Response:
    router.check_internal(request)
    tl = router.timeline
    items = [t.summary() for t in reversed(tl.traces.values())]
    return JSONResponse(
        {
            "requests": items,
            "keep": tl.keep,
            "exporter": tl.exporter.endpoint if tl.exporter is not None else None,
            "threads": sorted({t.name for t in threading.enumerate()}),  # an exporter shows here
        }
    )


async def show_request(router, request: Request, t0: float) -> Response:
    router.check_internal(request)
    ident = request.path_params.get("id", "")
    trace = router.timeline.find(ident)
    if trace is None:
        raise ApiError(404, f"no request {ident[:100]!r} in the timeline", param="id")
    spans = [s.to_json() for s in (trace.root, *trace.spans)]
    missing = []
    got = await asyncio.gather(*(_node_spans(router, url, rid) for _, url, rid in trace.nodes))
    for (role, url, rid), found in zip(trace.nodes, got, strict=True):
        if found is None:
            missing.append({"role": role, "node": url, "rid": rid})
        else:
            spans += [s for s in found if s.get("trace_id") == trace.trace_id]
    spans.sort(key=lambda s: (s["start_ns"], s["name"]))
    body = {**trace.summary(), "spans": spans, "unavailable": missing}
    return JSONResponse(body)


async def _node_spans(router, url: str, rid: str) -> list[dict] | None:
    try:
        resp = await router.clients.get(url).get(
            f"{url}/debug/spans/{rid}",
            headers=router.dispatcher.node_headers,
            timeout=NODE_FETCH_TIMEOUT_S,
        )
        if resp.status_code != 200:
            return None
        spans = resp.json().get("spans")
        return spans if isinstance(spans, list) else None
    except Exception as exc:  # a node gone or slow: the timeline shows what the router has
        logger.debug("spans of %s from %s: %s", rid, url, exc)
        return None
