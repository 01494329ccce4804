"""One Server-Sent Events frame, `data: <payload>\n\n`, as bytes: what the node fronts stream to
the router and the router streams to clients. orjson writes the JSON straight to bytes (no str
round trip per token)."""

from __future__ import annotations

from typing import Any

import orjson


def sse(payload: dict[str, Any] | str) -> bytes:
    """A dict is sent as JSON; a str (`[DONE]`) as it is."""
    if isinstance(payload, str):
        return b"data: " + payload.encode() + b"\n\n"
    return b"data: " + orjson.dumps(payload) + b"\n\n"
