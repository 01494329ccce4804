"""router/keepalive.py without a cluster: a client that leaves while the router pings (the stream
committed to 200, the dispatch still running) frees its admission slot and cancels the dispatch."""
from __future__ import annotations

import asyncio
import types

from starlette.responses import StreamingResponse

from router.keepalive import native_error, pinged_stream


def test_client_leaving_during_pings_frees_the_slot():
    released, observed = [], []

    async def main():
        router = types.SimpleNamespace(
            cfg=types.SimpleNamespace(sse_keepalive_s=0.05),
            admission=types.SimpleNamespace(release=lambda: released.append(1)),
            metrics=types.SimpleNamespace(observe_request=lambda *a: observed.append(a[1])))

        async def dispatch():           # a slow first token; its cancellation clean-up takes a step
            try:
                await asyncio.sleep(100)
            finally:
                await asyncio.sleep(0.01)
        opening = asyncio.create_task(dispatch())
        resp = StreamingResponse(pinged_stream(router, opening, "/generate", 0.0, lambda a: None, native_error),
                                 media_type="text/event-stream")
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():            # the client goes away after a few pings
            await asyncio.sleep(0.2)
            return {"type": "http.disconnect"}
        await resp({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
        await asyncio.sleep(0.1)
        assert any(m.get("body") == b": ping\n\n" for m in sent)
        assert opening.cancelled()

    asyncio.run(asyncio.wait_for(main(), 30))
    assert released == [1] and observed == [499]
