"""Reading a client's JSON body: size, media type, UTF-8, nesting, and values the nodes can take.

Everything here is a client error (4xx) and is decided before the body reaches a model or a node:

* larger than `max_bytes` -> 413 (the declared Content-Length is checked before reading);
* a Content-Type other than JSON -> 415 (a missing one is taken as JSON);
* not UTF-8, not JSON, not an object -> 400;
* nested deeper than `MAX_DEPTH` -> 400;
* NaN / Infinity / out-of-range floats, or strings with a lone UTF-16 surrogate (`"\\ud800"`) ->
  400 naming the field: they are not JSON the router could forward (httpx refuses to encode them).

The slow tree walk runs only when a cheap scan of the raw text says it could find something.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from starlette.requests import ClientDisconnect, Request

from pdserve.router.errors import ApiError

MAX_DEPTH = 64
BODY_TIMEOUT_S = 30.0  # to receive a whole body once its headers are in (as on the nodes)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


async def read_json_body(request: Request, max_bytes: int) -> Any:
    _check_media_type(request.headers.get("content-type"))
    raw = await _read_limited(request, max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8: {exc}", code="invalid_json") from None
    non_finite: list[str] = []

    def number(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            non_finite.append(literal)
        return value

    try:
        body = json.loads(text, parse_float=number, parse_constant=number)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    could_be_deep = text.count("[") + text.count("{") > MAX_DEPTH
    if non_finite or could_be_deep or _SURROGATE_ESCAPE.search(text):
        _check_tree(body)
    return body


def _check_media_type(content_type: str | None) -> None:
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(
            415,
            f"Content-Type {media or '(empty)'!r} is not JSON; send "
            "'Content-Type: application/json'",
            param="Content-Type",
            code="unsupported_media_type",
        )


async def _read_limited(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    chunks, size = [], 0
    try:
        # uvicorn waits for a body forever (its timeouts cover headers and idle keep-alive only):
        # a client trickling its body would hold the connection for good
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise _too_large(max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(
            408, f"request body not received within {BODY_TIMEOUT_S:g} s", code="body_timeout"
        ) from None
    except ClientDisconnect:
        raise ApiError(
            499, "client closed the request while sending the body", code="client_closed"
        ) from None
    return b"".join(chunks)


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"request body over {max_bytes} bytes", code="body_too_large")


def _too_deep() -> ApiError:
    return ApiError(400, f"the body is nested deeper than {MAX_DEPTH} levels", code="invalid_json")


def _check_tree(body: Any) -> None:
    """Walk the parsed body (iteratively: it may be deep) for the first value that cannot go on."""
    stack: list[tuple[Any, tuple, int]] = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise _bad_value(path, "NaN and Infinity are not JSON numbers; send a finite number")
        if isinstance(value, str) and not _encodable(value):
            raise _bad_value(path, "the string holds a lone UTF-16 surrogate; send valid Unicode")
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep()
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in reversed(list(items)):
                if isinstance(key, str) and not _encodable(key):
                    raise _bad_value(path, "a key holds a lone UTF-16 surrogate")
                stack.append((child, (*path, key), depth + 1))


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _bad_value(path: tuple, why: str) -> ApiError:
    param = ".".join(map(str, path)) or None
    return ApiError(400, f"{param}: {why}" if param else why, param=param, code="invalid_value")
