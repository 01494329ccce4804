"""SSE generators for an open attempt: OpenAI-shaped or native pass-through.

Each generator owns the attempt and the admission slot from its first step: whatever way it ends
(finished, node error, client gone and the generator cancelled) it closes the attempt once,
releases the slot and records the request. A client that goes away mid-stream leaves the attempt
unclosed at the `finally`, which then aborts the rid on both nodes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import httpx

from pdserve.infra.sse import sse
from pdserve.router.admission import Ticket
from pdserve.router.openai_api.responses import NodeAborted, StreamShaper
from pdserve.router.routing.attempt import Attempt

if TYPE_CHECKING:
    from pdserve.router.state import Router

CLIENT_CLOSED = 499


class StreamClock:
    """A stream's TTFT (from the request's arrival, `t0`) and mean gap between its events."""

    def __init__(self, t0: float):
        self.t0, self.ttft_s, self.events, self._first, self._last = t0, 0.0, 0, 0.0, 0.0

    def event(self) -> bool:
        """Records one event; True for the first."""
        now = time.perf_counter()
        self.events += 1
        if self.events == 1:
            self._first, self.ttft_s = now, now - self.t0
        self._last = now
        return self.events == 1

    def itl_s(self) -> float | None:
        return (self._last - self._first) / (self.events - 1) if self.events > 1 else None


async def openai_stream(
    router: Router,
    attempt: Attempt,
    shaper: StreamShaper,
    route: str,
    t0: float,
    ticket: Ticket,
) -> AsyncIterator[bytes]:
    status = 200
    clock = StreamClock(t0)
    try:
        try:
            async for event in attempt.events():
                chunks = shaper.chunks(event)
                if clock.event():
                    router.metrics.observe_ttft(clock.ttft_s)
                for chunk in chunks:
                    yield chunk
            cached = await attempt.cached_tokens()
            attempt.close(True)
            router.slo.finished(clock.ttft_s, clock.itl_s())
            for chunk in shaper.tail(cached):
                yield chunk
        except NodeAborted as exc:
            status = 502
            attempt.close(None, abort=True)
            for chunk in shaper.error(f"decode node {attempt.route.decode.url}: {exc.message}"):
                yield chunk
        except (httpx.HTTPError, TimeoutError) as exc:
            status = 502
            attempt.close(False, abort=True)
            message = (
                f"decode node {attempt.route.decode.url} failed mid-stream: "
                f"{type(exc).__name__} {exc}"
            )
            for chunk in shaper.error(message, code="decode_failed"):
                yield chunk
    finally:
        if not attempt.closed:
            status = CLIENT_CLOSED
            attempt.close(None, abort=True)
        ticket.release()
        router.metrics.observe_request(route, status, time.perf_counter() - t0)


async def native_stream(
    router: Router, attempt: Attempt, route: str, t0: float, ticket: Ticket
) -> AsyncIterator[bytes]:
    status = 200
    clock = StreamClock(t0)
    try:
        try:
            async for event in attempt.events():
                if clock.event():
                    router.metrics.observe_ttft(clock.ttft_s)
                yield sse(event)
                if event.get("error"):
                    status = 502
                    break
            attempt.close(True if status == 200 else None, abort=status != 200)
            if status == 200:
                router.slo.finished(clock.ttft_s, clock.itl_s())
        except NodeAborted as exc:
            status = 502
            attempt.close(None, abort=True)
            yield sse(
                {
                    "error": {
                        "message": f"decode node: {exc.message}",
                        "type": "server_error",
                        "code": "node_aborted",
                    },
                    "meta_info": {"finish_reason": {"type": "abort"}},
                }
            )
        except (httpx.HTTPError, TimeoutError) as exc:
            status = 502
            attempt.close(False, abort=True)
            yield sse(
                {
                    "error": {
                        "message": f"decode node failed mid-stream: {exc!r}",
                        "type": "server_error",
                        "code": "decode_failed",
                    },
                    "meta_info": {"finish_reason": {"type": "abort"}},
                }
            )
        yield sse("[DONE]")
    finally:
        if not attempt.closed:
            status = CLIENT_CLOSED
            attempt.close(None, abort=True)
        ticket.release()
        router.metrics.observe_request(route, status, time.perf_counter() - t0)
