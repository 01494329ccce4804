"""`ApiError`: an answer other than 200, with an OpenAI-style error body; every router module
raises it for what a client or a node got wrong."""

from __future__ import annotations


class ApiError(Exception):
    """An answer other than 200, with an OpenAI-style body `{"error": {...}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        body: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.body = body or {
            "error": {"message": message, "type": type, "param": param, "code": code}
        }
