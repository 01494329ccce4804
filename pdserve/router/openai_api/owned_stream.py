"""A streamed answer whose generator owns the request's admission ticket and open attempts.

The SSE generators (streams.py, keepalive.py, n_choices.py) release what they own in their
`finally`, which runs only once they have started. Starlette starts a streaming body in a task
beside the one that listens for the client's disconnect (ASGI spec < 2.4, as uvicorn reports), and
a client that left before the answer started has that task cancelled before its first step: the
generator never runs, nor does its `finally`, and the ticket's units would be held for good.
`OwnedStream` notices a body that never started and runs `abandon`, which releases the same.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse

from pdserve.router.admission import Ticket
from pdserve.router.openai_api.keepalive import abort_opened
from pdserve.router.openai_api.streams import CLIENT_CLOSED
from pdserve.router.routing.attempt import Attempt

if TYPE_CHECKING:
    from pdserve.router.state import Router


class OwnedStream(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], abandon: Callable[[], None], **kw):
        self.started = False
        self._abandon = abandon
        super().__init__(self._marked(content), media_type="text/event-stream", **kw)

    async def _marked(self, content: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        self.started = True
        async for chunk in content:
            yield chunk

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.started:
                self.started = True
                self._abandon()


def abandon(
    router: Router,
    route: str,
    t0: float,
    ticket: Ticket,
    attempts: Sequence[Attempt] = (),
    opening: asyncio.Task | None = None,
) -> Callable[[], None]:
    """What a generator that never started would have released: its attempts (aborted), the
    dispatch still running (cancelled; what it opens is aborted), the ticket; the request is
    recorded as the client's leaving. Never awaits: it runs inside a cancelled task."""

    def run() -> None:
        for a in attempts:
            if not a.closed:
                a.close(None, abort=True)
        if opening is not None:
            if opening.done():
                abort_opened(opening)
            else:
                opening.add_done_callback(abort_opened)
                opening.cancel()
        ticket.release()
        router.metrics.observe_request(route, CLIENT_CLOSED, time.perf_counter() - t0)

    return run
