"""The router's timeline (router/timeline.py) stays bounded whatever traceparent clients send:
one reused by every request must not grow the rid map (issue #45: it grew without bound)."""

from __future__ import annotations

from pdserve.router.timeline import RequestTrace, Timeline

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _request(rid: str, traceparent: str | None) -> RequestTrace:
    trace = RequestTrace("/generate", traceparent)
    trace.attempt_start(rid, [("prefill", "http://p"), ("decode", "http://d")])
    trace.attempt_end(rid, True, "length")
    return trace


def test_a_reused_traceparent_keeps_the_timeline_bounded():
    timeline = Timeline(keep=4, exporter=None)
    for i in range(1000):
        timeline.end(_request(f"rid{i}", TRACEPARENT), 200)
    assert len(timeline.traces) == 1
    assert len(timeline.by_rid) <= 2 * 4  # two node entries per attempt, of the kept traces
    newest = timeline.find("rid999")
    assert newest is not None and newest.trace_id == TRACEPARENT.split("-")[1]
    assert timeline.find("rid0") is None


def test_distinct_traces_keep_the_last_n_and_find_them_by_rid():
    timeline = Timeline(keep=3, exporter=None)
    for i in range(10):
        timeline.end(_request(f"rid{i}", None), 200)
    assert len(timeline.traces) == 3 and len(timeline.by_rid) == 3
    assert [timeline.find(f"chatcmpl-rid{i}") is not None for i in (6, 7, 8, 9)] == [
        False, True, True, True,
    ]  # fmt: skip
