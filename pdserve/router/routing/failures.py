"""How an attempt's failure before the client saw a byte is described: a concern of its own,
apart from running the attempt, that the dispatcher reads to retry, blame and answer."""

from __future__ import annotations

import json

import httpx

from pdserve.router.errors import ApiError
from pdserve.router.openai_api.responses import NodeAborted
from pdserve.router.routing.worker import Worker


class Failure(Exception):
    """An attempt failed before the client saw a byte. `node_fault` says whether the culprit's
    breaker counts it; `body` (optional) is a node's own 4xx body, passed through."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str,
        retryable: bool,
        culprit: Worker | None,
        node_fault: bool,
        body: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.code, self.body = status, message, code, body
        self.retryable, self.culprit, self.node_fault = retryable, culprit, node_fault

    def to_api_error(self) -> ApiError:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return ApiError(self.status, self.message, type=kind, code=self.code, body=self.body)


def node_failure(worker: Worker, resp: httpx.Response, body: bytes) -> Failure:
    """A node's non-200 answer before any byte: 4xx pass through (408/429 retried), 5xx → 502."""
    try:
        parsed = json.loads(body)
        message = parsed["error"]["message"]
    except (ValueError, KeyError, TypeError):
        parsed, message = None, body[:200].decode(errors="replace")
    status = resp.status_code
    text = f"{worker.role} node {worker.url} answered {status}: {message}"
    overloaded = (
        status == 503
        and isinstance(parsed, dict)
        and isinstance(parsed.get("error"), dict)
        and parsed["error"].get("code") in ("node_overloaded", "role_change")
    )  # role_change: an elastic node leaving the role this leg needs (docs/ROUTER.md)
    if status in (408, 429) or overloaded:
        return Failure(
            503, text, code="node_busy", retryable=True, culprit=worker, node_fault=False
        )
    if status in (401, 403):
        # the node does not take this router's secret, or (decode) has not got the prefill node on
        # its bootstrap allowlist yet: the cluster's fault, not the client's; another pair may work
        worker.pushed_servers = None
        return Failure(
            502,
            text,
            code=f"{worker.role}_refused",
            retryable=True,
            culprit=worker,
            node_fault=True,
        )
    if status < 500:
        good = isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
        return Failure(
            status,
            message if good else text,
            code="node_rejected",
            retryable=False,
            culprit=worker,
            node_fault=False,
            body=parsed if good else None,
        )
    return Failure(
        502, text, code=f"{worker.role}_failed", retryable=True, culprit=worker, node_fault=True
    )


def unreachable(worker: Worker, exc: BaseException) -> Failure:
    return Failure(
        502,
        f"{worker.role} node {worker.url} failed: {type(exc).__name__}: {exc}",
        code=f"{worker.role}_failed",
        retryable=True,
        culprit=worker,
        node_fault=True,
    )


def aborted(worker: Worker, exc: NodeAborted) -> Failure:
    return Failure(
        502,
        f"{worker.role} node {worker.url} aborted the request: {exc.message}",
        code=f"{worker.role}_aborted",
        retryable=True,
        culprit=worker,
        node_fault=False,
    )
