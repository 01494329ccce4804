"""What a node front checks and builds from a request body before anything reaches a rank: the
prompt's token ids (text, chat messages or ids), its client errors, and the SSE framing."""

from __future__ import annotations

from typing import Any

import orjson


class RequestError(Exception):
    """A client error, answered with an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        }


def prompt_ids(tok: Any, body: dict[str, Any], vocab_size: int) -> list[int]:
    """The prompt of a /generate body: exactly one of `text`, `messages`, `input_ids`."""
    given = [k for k in ("text", "messages", "input_ids") if body.get(k) is not None]
    if len(given) != 1:
        raise RequestError(
            400, "exactly one of 'text', 'messages', 'input_ids' is required", "text"
        )
    kind = given[0]
    if kind == "text":
        if not isinstance(body["text"], str):
            raise RequestError(400, "'text' must be a string", "text")
        ids = tok(body["text"])["input_ids"]
    elif kind == "messages":
        from runtime.chat_template import render  # it raises this module's RequestError

        text = render(tok, body)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
        ):
            raise RequestError(
                400,
                f"'input_ids' must be a list of integers in [0, {vocab_size})",
                "input_ids",
            )
    if not ids:
        raise RequestError(400, f"the prompt ('{kind}') is empty", kind)
    return list(ids)


def sse(obj: dict[str, Any] | str) -> bytes:
    if isinstance(obj, str):
        return f"data: {obj}\n\n".encode()
    return b"data: " + orjson.dumps(obj) + b"\n\n"
