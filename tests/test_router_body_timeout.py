"""router/openai_api/json_body.py: a client that sends its headers and then trickles (or stops
sending) its body gets 408 after BODY_TIMEOUT_S instead of holding the connection for good."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from pdserve.router.errors import ApiError
from pdserve.router.openai_api import json_body


def test_a_stalled_body_times_out(monkeypatch):
    monkeypatch.setattr(json_body, "BODY_TIMEOUT_S", 0.2)

    async def receive():  # one byte, then silence
        if not sent:
            sent.append(1)
            return {"type": "http.request", "body": b"{", "more_body": True}
        await asyncio.sleep(3600)

    sent: list[int] = []
    request = Request(
        {"type": "http", "method": "POST", "headers": [(b"content-type", b"application/json")]},
        receive,
    )

    async def main():
        with pytest.raises(ApiError) as e:
            await json_body.read_json_body(request, 1 << 20)
        return e.value

    err = asyncio.run(asyncio.wait_for(main(), 30))
    assert err.status == 408 and err.body["error"]["code"] == "body_timeout"
