"""router/openai_api/keepalive.py without a cluster: a client that leaves while the router pings
(the stream committed to 200, the dispatch still running) frees its admission slot and cancels the
dispatch."""

from __future__ import annotations

import asyncio
import contextlib
import types

from starlette.responses import StreamingResponse

from pdserve.router.openai_api.keepalive import native_error, pinged_stream


def test_client_leaving_during_pings_frees_the_slot():
    released, observed = [], []

    ticket = types.SimpleNamespace(release=lambda: released.append(1))  # the admission's

    async def main():
        router = types.SimpleNamespace(
            cfg=types.SimpleNamespace(sse_keepalive_s=0.05),
            metrics=types.SimpleNamespace(observe_request=lambda *a: observed.append(a[1])),
        )

        async def dispatch():  # a slow first token; its cancellation clean-up takes a step
            try:
                await asyncio.sleep(100)
            finally:
                await asyncio.sleep(0.01)

        opening = asyncio.create_task(dispatch())
        resp = StreamingResponse(
            pinged_stream(router, opening, "/generate", 0.0, lambda a: None, native_error, ticket),
            media_type="text/event-stream",
        )
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():  # the client goes away after a few pings
            await asyncio.sleep(0.2)
            return {"type": "http.disconnect"}

        await resp({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        await asyncio.sleep(0.1)
        assert any(m.get("body") == b": ping\n\n" for m in sent)
        assert opening.cancelled()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert released == [1] and observed == [499]


def test_an_attempt_that_opens_as_the_client_leaves_is_aborted():
    """The dispatch ends in the same loop step as the client's disconnect cancels the pings: the
    attempt it returned is closed (aborted), not left open on its nodes."""
    released, closed = [], []

    class FakeAttempt:
        def close(self, ok, abort=False):
            closed.append((ok, abort))

    ticket = types.SimpleNamespace(release=lambda: released.append(1))  # the admission's

    async def main():
        router = types.SimpleNamespace(
            cfg=types.SimpleNamespace(sse_keepalive_s=0.05),
            metrics=types.SimpleNamespace(observe_request=lambda *a: None),
        )
        opening = asyncio.get_running_loop().create_future()
        gen = pinged_stream(router, opening, "/generate", 0.0, lambda a: None, native_error, ticket)
        assert await gen.__anext__() == b": ping\n\n"
        nxt = asyncio.ensure_future(gen.__anext__())  # waiting in the ping loop
        await asyncio.sleep(0.01)
        opening.set_result(FakeAttempt())
        nxt.cancel()  # and the client leaves in the same step
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await nxt

    asyncio.run(asyncio.wait_for(main(), 30))
    assert released == [1] and closed == [(None, True)]
