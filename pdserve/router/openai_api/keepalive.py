"""SSE keep-alive while a streaming request waits for its first token.

A streaming answer normally starts once the decode node produced its first event, so the router can
still retry on another pair (or answer a plain 4xx/5xx) before the client got a byte. When that
takes longer than `sse_keepalive_s`, proxies with 30-60 s idle timeouts would cut the connection:
the router then commits to a 200 stream and sends an SSE comment (`: ping`, which SSE clients
ignore) every `sse_keepalive_s` until the attempt opens; a failure after that is an error event in
the stream, as any mid-stream failure is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from pdserve.infra.sse import sse
from pdserve.router.admission import Ticket
from pdserve.router.errors import ApiError
from pdserve.router.openai_api.responses import StreamShaper
from pdserve.router.routing.attempt import Attempt

if TYPE_CHECKING:
    from pdserve.router.state import Router

PING = b": ping\n\n"


async def pinged_stream(
    router: Router,
    opening: asyncio.Task,
    route: str,
    t0: float,
    stream: Callable[[Attempt], AsyncIterator[bytes]],
    error: Callable[[ApiError], list[bytes]],
    ticket: Ticket,
) -> AsyncIterator[bytes]:
    """Pings until `opening` (the dispatch) ends, then the attempt's `stream` (which owns the
    admission slot from its first step) or `error`'s events. If the client leaves first, the
    dispatch is cancelled, which aborts whatever it opened."""
    handed_over = False
    status = 200
    try:
        while not opening.done():
            done, _ = await asyncio.wait({opening}, timeout=router.cfg.sse_keepalive_s)
            if not done:
                yield PING
        try:
            attempt = opening.result()
        except ApiError as exc:
            status = exc.status
            for chunk in error(exc):
                yield chunk
            return
        inner = stream(attempt)
        handed_over = True
        try:
            async for chunk in inner:
                yield chunk
        finally:
            await inner.aclose()
    finally:
        if not opening.done():
            # The client left (this generator is cancelled, or closed). No await here: under
            # Starlette's cancelled scope every await raises again, and the slot would never be
            # released. The dispatch's own cancellation clean-up closes what it opened; an attempt
            # it still returns is aborted by the callback.
            status = 499
            opening.add_done_callback(abort_opened)
            opening.cancel()
        elif not handed_over and not opening.cancelled() and opening.exception() is None:
            status = 499  # it opened just as the client left: nobody streams it
            abort_opened(opening)
        if not handed_over:
            ticket.release()
            router.metrics.observe_request(route, status, time.perf_counter() - t0)


def abort_opened(opening: asyncio.Task) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close(None, abort=True)


def native_error(exc: ApiError) -> list[bytes]:
    err = exc.body.get("error") if isinstance(exc.body, dict) else None
    return [
        sse(
            {
                "error": err or {"message": str(exc), "type": "server_error", "code": None},
                "meta_info": {"finish_reason": {"type": "abort"}},
            }
        ),
        sse("[DONE]"),
    ]


def openai_error(exc: ApiError) -> list[bytes]:
    err = exc.body.get("error") if isinstance(exc.body, dict) else None
    err = err if isinstance(err, dict) else {}
    return StreamShaper.error(
        str(err.get("message") or exc), code=err.get("code") or "request_failed"
    )
