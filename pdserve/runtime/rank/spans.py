"""A rank's span recorder: the stages of traced requests, as side data (docs/TRACING.md).

A request is traced when its AddRequest carries a traceparent; for any other request every call
here is one dictionary lookup that finds nothing. Times come from the rank's own wall clock and are
never read by a decision: the recorder only collects `SpanRecord`s, which the rank's stats push
carries to the front (runtime/rank/front_link.py StatsReporter), which exports them. Nothing here
blocks, and the unsent records are bounded (the oldest are dropped and counted).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.batch import BatchEntry
from pdserve.runtime.messages import SPANS_PER_PUSH, SpanRecord

MAX_UNSENT = 4 * SPANS_PER_PUSH
MAX_TRACED = 4096  # traced requests a rank follows at once (beyond: new ones are not traced)


@dataclass
class _Open:
    start_ns: int
    parent: str
    attrs: dict[str, int | float | str]
    events: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class _Traced:
    open: dict[str, _Open] = field(default_factory=dict)
    seq: dict[str, int] = field(default_factory=dict)


def now_ns() -> int:
    return time.time_ns()


class RankSpans:
    def __init__(self, role: str = "node"):
        self.role = role  # name prefix: prefill, decode, node
        self._traced: dict[str, _Traced] = {}
        self._done: deque[SpanRecord] = deque()
        self.dropped = 0
        # monotonic seconds (the transfer ends' timestamps) -> Unix ns on this rank's clock
        self._mono_offset = time.time_ns() - time.monotonic_ns()

    def trace(self, rid: str, traceparent: str | None) -> None:
        """Follows `rid` when its request came with a trace context."""
        if traceparent and len(self._traced) < MAX_TRACED:
            self._traced[rid] = _Traced()

    @property
    def active(self) -> bool:
        """Any traced request on this rank (the one check a turn pays when tracing is off)."""
        return bool(self._traced)

    def on(self, rid: str) -> bool:
        return rid in self._traced

    def wall_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._mono_offset

    def start(self, rid: str, name: str, parent: str = "", t_ns: int | None = None, **attrs):
        t = self._traced.get(rid)
        if t is not None:
            t.open[name] = _Open(t_ns or now_ns(), parent, dict(attrs))

    def end(self, rid: str, name: str, t_ns: int | None = None, **attrs) -> None:
        t = self._traced.get(rid)
        if t is None:
            return
        o = t.open.pop(name, None)
        if o is not None:
            o.attrs.update(attrs)
            self._record(rid, t, name, o.parent, o.start_ns, t_ns or now_ns(), o.attrs, o.events)

    def span(self, rid: str, name: str, start_ns: int, end_ns: int, parent: str = "", **attrs):
        """A whole span at once (its start known from elsewhere: a transfer end, a forward)."""
        t = self._traced.get(rid)
        if t is not None:
            self._record(rid, t, name, parent, start_ns, end_ns, dict(attrs), [])

    def prompt_chunks(self, entries: list[BatchEntry], start_ns: int, end_ns: int) -> None:
        """A forward's prompt chunks (not decode steps: a span each would flood the trace), each
        ending its request's wait for its first forward."""
        for e in entries:
            if e.req.rid in self._traced and (e.num_new > 1 or e.start < e.req.prompt_len):
                self.end(e.req.rid, "waiting", t_ns=start_ns)
                self.span(e.req.rid, "chunk", start_ns, end_ns, start=e.start, tokens=e.num_new)

    def event(self, rid: str, span: str, name: str) -> None:
        """An event on the open span `span` (decode: retracted, resumed)."""
        t = self._traced.get(rid)
        if t is not None and span in t.open:
            t.open[span].events.append((name, now_ns()))

    def is_open(self, rid: str, name: str) -> bool:
        t = self._traced.get(rid)
        return t is not None and name in t.open

    def finish(self, rid: str, reason: str, **attrs) -> None:
        """The request is over on this rank: a `finish` span with its reason; spans still open
        end here, marked unfinished."""
        t = self._traced.pop(rid, None)
        if t is None:
            return
        now = now_ns()
        for name, o in t.open.items():
            o.attrs["unfinished"] = 1
            self._record(rid, t, name, o.parent, o.start_ns, now, o.attrs, o.events)
        self._record(rid, t, "finish", "", now, now, {"finish_reason": reason, **attrs}, [])

    def drain(self) -> list[SpanRecord]:
        """The finished records for the next stats push (at most SPANS_PER_PUSH)."""
        n = min(len(self._done), SPANS_PER_PUSH)
        return [self._done.popleft() for _ in range(n)]

    def _record(self, rid, t: _Traced, name, parent, start_ns, end_ns, attrs, events) -> None:
        seq = t.seq.get(name, 0)
        t.seq[name] = seq + 1
        full = f"{self.role}.{name}"
        par = f"{self.role}.{parent}" if parent else ""
        self._done.append(SpanRecord(rid, full, par, seq, start_ns, end_ns, attrs, events))
        if len(self._done) > MAX_UNSENT:
            self._done.popleft()
            self.dropped += 1
