"""Build OpenAI responses (whole and streamed) from the decode node's native answers.

The router has no tokenizer: a logprob entry's token text is the node's text when it sends one
(`[id, logprob, top, text]`, top entries `[id, logprob, text]`) and `"token_id:<id>"` otherwise.
"""

from __future__ import annotations

from typing import Any

import orjson

_FINISH = {"stop": "stop", "length": "length"}


class NodeAborted(Exception):
    """The node ended the request with finish_reason `abort` or an error chunk."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {data}\n\n"


def finish_reason(meta: dict) -> str | None:
    """The OpenAI finish_reason of a native meta_info; raises NodeAborted for `abort`."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        message = reason.get("message") if isinstance(reason, dict) else None
        raise NodeAborted(message or "the node aborted the request")
    return _FINISH.get(kind, "stop")


def check_event(event: dict) -> None:
    """Raise NodeAborted when a native answer or stream chunk reports an error."""
    error = event.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else str(error)
        raise NodeAborted(message or "the node reported an error")
    finish_reason(event.get("meta_info") or {})


def usage(meta: dict) -> dict[str, int]:
    prompt = int(meta.get("prompt_tokens") or 0)
    completion = int(meta.get("completion_tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _token(entry: list, text_at: int) -> str:
    if len(entry) > text_at and isinstance(entry[text_at], str):
        return entry[text_at]
    return f"token_id:{entry[0]}"


def chat_logprobs(entries: list | None) -> dict | None:
    if not entries:
        return None
    content = []
    for entry in entries:
        tok = _token(entry, 3)
        tops = entry[2] if len(entry) > 2 and entry[2] else []
        content.append(
            {
                "token": tok,
                "logprob": float(entry[1]),
                "bytes": list(tok.encode()),
                "top_logprobs": [
                    {
                        "token": _token(t, 2),
                        "logprob": float(t[1]),
                        "bytes": list(_token(t, 2).encode()),
                    }
                    for t in tops
                ],
            }
        )
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list | None, offset: int = 0) -> dict | None:
    if not entries:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for entry in entries:
        tok = _token(entry, 3)
        offsets.append(offset)
        offset += len(tok)
        tokens.append(tok)
        lps.append(float(entry[1]))
        top = entry[2] if len(entry) > 2 and entry[2] else []
        tops.append({_token(t, 2): float(t[1]) for t in top})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_completion(rid: str, model: str, created: int, native: dict, logprobs: bool) -> dict:
    meta = native.get("meta_info") or {}
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": native.get("text", "")},
        "logprobs": chat_logprobs(meta.get("logprobs")) if logprobs else None,
        "finish_reason": finish_reason(meta) or "stop",
    }
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(meta),
    }


def text_completion(rid: str, model: str, created: int, native: dict, logprobs: bool) -> dict:
    meta = native.get("meta_info") or {}
    choice = {
        "index": 0,
        "text": native.get("text", ""),
        "logprobs": completion_logprobs(meta.get("logprobs")) if logprobs else None,
        "finish_reason": finish_reason(meta) or "stop",
    }
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage(meta),
    }


class StreamShaper:
    """Turns native stream chunks into OpenAI SSE chunks for one request.

    `chunks(event)` returns the SSE strings for one native chunk (raises NodeAborted on an error
    chunk); `tail()` the usage chunk (when asked for) and `[DONE]`; `error(msg)` an error event.
    """

    def __init__(
        self, kind: str, rid: str, model: str, created: int, include_usage: bool, logprobs: bool
    ):
        assert kind in ("chat", "completion"), kind
        self.kind, self.rid, self.model, self.created = kind, rid, model, created
        self.include_usage, self.logprobs = include_usage, logprobs
        self.started = False
        self.meta: dict = {}
        self.text_len = 0

    def _frame(self, choice: dict) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        if self.include_usage:
            out["usage"] = None
        return sse(out)

    def chunks(self, event: dict) -> list[str]:
        check_event(event)
        meta = event.get("meta_info") or {}
        self.meta.update(
            {k: v for k, v in meta.items() if k in ("prompt_tokens", "completion_tokens")}
        )
        text = event.get("text") or ""
        reason = finish_reason(meta)
        entries = meta.get("logprobs") if self.logprobs else None
        out = []
        if self.kind == "chat":
            if not self.started:
                out.append(
                    self._frame(
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                )
            if text or reason or entries:
                delta = {"content": text} if text else {}
                out.append(
                    self._frame(
                        {
                            "index": 0,
                            "delta": delta,
                            "logprobs": chat_logprobs(entries),
                            "finish_reason": reason,
                        }
                    )
                )
        elif text or reason or entries:
            out.append(
                self._frame(
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": completion_logprobs(entries, self.text_len),
                        "finish_reason": reason,
                    }
                )
            )
        self.text_len += len(text)
        self.started = True
        return out

    def tail(self) -> list[str]:
        out = []
        if self.include_usage:
            obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
            out.append(
                sse(
                    {
                        "id": self.rid,
                        "object": obj,
                        "created": self.created,
                        "model": self.model,
                        "choices": [],
                        "usage": usage(self.meta),
                    }
                )
            )
        out.append(sse("[DONE]"))
        return out

    @staticmethod
    def error(message: str, code: str = "node_aborted") -> list[str]:
        return [
            sse(
                {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
            ),
            sse("[DONE]"),
        ]


def parse_sse_line(line: str) -> dict | None | str:
    """A native SSE line: the decoded JSON, "[DONE]", or None for lines that carry no data."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return "[DONE]"
    try:
        value: Any = orjson.loads(data)
    except ValueError:
        raise NodeAborted(f"the node sent a malformed stream line: {data[:80]!r}") from None
    if not isinstance(value, dict):
        raise NodeAborted("the node sent a stream chunk that is not an object")
    return value
