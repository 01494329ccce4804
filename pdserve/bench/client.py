"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

TTFT is the arrival of the first chunk with non-empty content (a chat stream's first chunk often
carries only the role). Output tokens come from the server's `usage` (asked for with
`stream_options.include_usage`); a server that sends none gets its content chunks counted instead.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdserve.bench.workload import BenchRequest


@dataclass(frozen=True)
class Target:
    base_url: str  # http://host:port (no /v1)
    endpoint: str  # "chat" | "completions"
    model: str
    api_key: str | None = None
    ignore_eos: bool = True
    extra_body: dict = field(default_factory=dict)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def payload(self, req: BenchRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.endpoint == "chat":
            body["messages"] = req.chat_messages()
        else:
            assert req.prompt is not None, "chat messages need the chat endpoint"
            body["prompt"] = req.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


@dataclass(eq=False)
class RequestRecord:
    """What one request did. Times are perf_counter seconds;
    `chunk_times` are relative to `start`."""

    request: BenchRequest
    warmup: bool = False
    start: float = 0.0
    end: float | None = None
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # from the server's usage
    usage_completion_tokens: int | None = None
    error: str | None = None  # kind: http_429, connect_error, timeout, ...
    status: int | None = None
    error_body: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None

    @property
    def max_tokens(self) -> int:
        return self.request.max_tokens

    @property
    def output_tokens(self) -> int:
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return len(self.chunk_times)

    @property
    def e2e(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def itl(self) -> float | None:
        """Mean time between output tokens after the first: (e2e - ttft) / (tokens - 1)."""
        if self.ttft is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def fail(self, kind: str, status: int | None = None, body: str | None = None) -> None:
        self.error, self.status = kind, status
        self.error_body = body[:500] if body else None
        self.end = time.perf_counter()


def _content(chunk: dict) -> str:
    """The output text of a chunk: chat content (and reasoning, which is output too) or completion
    text."""
    parts = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        texts = (
            [delta.get("content"), delta.get("reasoning_content")]
            if isinstance(delta, dict)
            else [choice.get("text")]
        )
        parts += [t for t in texts if isinstance(t, str)]
    return "".join(parts)


async def send(
    client: httpx.AsyncClient, target: Target, rec: RequestRecord, timeout_s: float
) -> None:
    """Sends `rec.request` and fills `rec` in place (so a cancelled request still leaves its
    record). `timeout_s` bounds the whole request, however slowly its chunks trickle in."""
    rec.start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, target, rec)
    except TimeoutError:
        rec.fail("timeout", rec.status, f"no complete answer within {timeout_s:g} s")


async def _stream(client: httpx.AsyncClient, target: Target, rec: RequestRecord) -> None:
    req = rec.request
    try:
        async with client.stream(
            "POST",
            target.base_url + target.path,
            json=target.payload(req),
            headers=target.headers(),
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.fail(f"http_{resp.status_code}", resp.status_code, body)
                return
            rec.status = 200
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                try:
                    chunk = json.loads(data)
                except ValueError:
                    rec.fail("bad_stream", 200, data)
                    return
                if not isinstance(chunk, dict):
                    rec.fail("bad_stream", 200, data)
                    return
                if chunk.get("error"):
                    rec.fail("stream_error", 200, json.dumps(chunk["error"]))
                    return
                if _content(chunk):
                    if rec.ttft is None:
                        rec.ttft = now - rec.start
                    rec.chunk_times.append(now - rec.start)
                usage = chunk.get("usage")
                if isinstance(usage, dict):
                    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                    rec.usage_completion_tokens = usage.get(
                        "completion_tokens", rec.usage_completion_tokens
                    )
            if not done:
                rec.fail("incomplete_stream", 200, "the stream ended without data: [DONE]")
                return
            rec.end = time.perf_counter()
    except httpx.ConnectError as e:
        rec.fail("connect_error", None, str(e))
    except httpx.TimeoutException as e:
        rec.fail("timeout", None, str(e) or type(e).__name__)
    except httpx.HTTPError as e:  # connection dropped mid-stream, protocol errors
        rec.fail("read_error", None, f"{type(e).__name__}: {e}")
