"""OwnedStream (pdserve/router/openai_api/owned_stream.py) under Starlette's real streaming path:
a client gone before the body starts (Starlette then cancels the body's task before its first step)
gets the generator's resources released by `abandon`; a body that ran releases them itself."""

from __future__ import annotations

import asyncio

from fastapi.responses import StreamingResponse

from pdserve.router.openai_api.owned_stream import OwnedStream

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST"}


def run(response: OwnedStream, receive) -> list[dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)
        await asyncio.sleep(0)  # a server's write yields to the loop

    asyncio.run(asyncio.wait_for(response(SCOPE, receive, send), 5))
    return sent


def test_a_body_the_client_left_before_it_started_is_abandoned():
    ran, abandoned = [], []

    async def body():
        ran.append(True)
        try:
            yield b"data: 1\n\n"
        finally:
            ran.append("finally")

    async def gone():
        return {"type": "http.disconnect"}

    run(OwnedStream(body(), lambda: abandoned.append(1)), gone)
    assert ran == [] and abandoned == [1]  # the generator never ran; abandon did, once
    # the leak it closes: under a plain StreamingResponse the generator never runs, nor its finally
    run(StreamingResponse(body()), gone)
    assert ran == []


def test_a_body_that_ran_is_not_abandoned():
    ran, abandoned = [], []

    async def body():
        ran.append(True)
        yield b"data: 1\n\n"

    async def stays():
        await asyncio.sleep(3600)  # never disconnects; the body's end ends the response

    sent = run(OwnedStream(body(), lambda: abandoned.append(1)), stays)
    assert ran == [True] and abandoned == []
    assert any(m.get("body") == b"data: 1\n\n" for m in sent)
