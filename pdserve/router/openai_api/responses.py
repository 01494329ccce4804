"""Build OpenAI responses (whole and streamed) from the decode node's native answers.

The router has no tokenizer: a logprob entry's token text and bytes are the node's (`[id, logprob,
top, text, bytes]`, top entries `[id, logprob, text, bytes]`, runtime/front/token_text.py), and
`"token_id:<id>"` (its UTF-8 as bytes) for a node that sends no text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from pdserve.infra.sse import sse
from pdserve.router.tools.request import ToolPlan

_FINISH = {"stop": "stop", "length": "length"}


class NodeAborted(Exception):
    """The node ended the request with finish_reason `abort` or an error chunk. `code`: the
    node's AbortReason (runtime/reasons.py), when it sent one."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message, self.code = message, code


def finish_reason(meta: dict) -> str | None:
    """The OpenAI finish_reason of a native meta_info; raises NodeAborted for `abort`."""
    reason = meta.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort":
        message = reason.get("message") if isinstance(reason, dict) else None
        code = reason.get("code") if isinstance(reason, dict) else None
        raise NodeAborted(
            message or "the node aborted the request", code if isinstance(code, str) else None
        )
    return _FINISH.get(kind, "stop")


def check_event(event: dict) -> None:
    """Raise NodeAborted when a native answer or stream chunk reports an error."""
    error = event.get("error")
    if error:
        message = error.get("message") if isinstance(error, dict) else str(error)
        code = error.get("code") if isinstance(error, dict) else None
        raise NodeAborted(
            message or "the node reported an error", code if isinstance(code, str) else None
        )
    finish_reason(event.get("meta_info") or {})


def usage(meta: dict, cached: int | None) -> dict[str, Any]:
    """OpenAI usage; `cached`: prompt tokens the prefix cache held (None: unknown)."""
    prompt = int(meta.get("prompt_tokens") or 0)
    completion = int(meta.get("completion_tokens") or 0)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
    }


def stop_reason(meta: dict, stop_token_ids: frozenset[int]) -> str | int | None:
    """vLLM's `stop_reason`: the stop string or the stop token id that ended the answer; None when
    it ended otherwise (length, or the model's EOS token, which is no stop token of the request)."""
    reason = meta.get("finish_reason")
    matched = reason.get("matched") if isinstance(reason, dict) else None
    if isinstance(matched, str) or (isinstance(matched, int) and matched in stop_token_ids):
        return matched
    return None


def _token(entry: list, text_at: int, as_ids: bool = False) -> tuple[str, list[int]]:
    """(text, bytes) of a logprob entry: the node's; the text is `token_id:<id>` when the node sent
    none or the client asked for ids (vLLM's return_tokens_as_token_ids)."""
    has_text = len(entry) > text_at and isinstance(entry[text_at], str)
    text = entry[text_at] if has_text and not as_ids else f"token_id:{entry[0]}"
    raw = entry[text_at + 1] if has_text and len(entry) > text_at + 1 else None
    if isinstance(raw, list) and all(type(b) is int and 0 <= b < 256 for b in raw):
        return text, raw
    return text, list((entry[text_at] if has_text else text).encode())


def _tops(entry: list) -> list:
    return entry[2] if len(entry) > 2 and entry[2] else []


def chat_logprobs(entries: list | None, as_ids: bool = False) -> dict | None:
    if not entries:
        return None
    content = []
    for entry in entries:
        tok, raw = _token(entry, 3, as_ids)
        top = []
        for t in _tops(entry):
            alt, alt_raw = _token(t, 2, as_ids)
            top.append({"token": alt, "logprob": float(t[1]), "bytes": alt_raw})
        content.append(
            {"token": tok, "logprob": float(entry[1]), "bytes": raw, "top_logprobs": top}
        )
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list | None, offset: int = 0, as_ids: bool = False) -> dict | None:
    """`offset`: characters of the answer before these tokens (the sum of the earlier tokens')."""
    if not entries:
        return None
    tokens, lps, tops, offsets = [], [], [], []
    for entry in entries:
        tok, _ = _token(entry, 3, as_ids)
        offsets.append(offset)
        offset += len(_token(entry, 3)[0])
        tokens.append(tok)
        lps.append(float(entry[1]))
        tops.append({_token(t, 2, as_ids)[0]: float(t[1]) for t in _tops(entry)})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


@dataclass(frozen=True)
class Shape:
    """What a request asked for that shapes its answer (besides the node's output)."""

    kind: str  # "chat" | "completion"
    rid: str
    model: str
    created: int
    logprobs: bool = False
    include_usage: bool = False  # streaming: a usage chunk before [DONE]
    stop_token_ids: frozenset[int] = frozenset()
    tokens_as_ids: bool = False  # logprob tokens as "token_id:<id>"
    tools: ToolPlan | None = None  # chat with tools: answers read for tool calls


def answer_choice(shape: Shape, native: dict, index: int = 0) -> dict[str, Any]:
    """One choice of a whole answer, from a native answer."""
    meta = native.get("meta_info") or {}
    choice: dict[str, Any] = {"index": index}
    if shape.kind == "chat":
        text = native.get("text", "")
        choice["message"] = (
            shape.tools.message(text) if shape.tools else {"role": "assistant", "content": text}
        )
        choice["logprobs"] = (
            chat_logprobs(meta.get("logprobs"), shape.tokens_as_ids) if shape.logprobs else None
        )
    else:
        choice["text"] = native.get("text", "")
        choice["logprobs"] = (
            completion_logprobs(meta.get("logprobs"), 0, shape.tokens_as_ids)
            if shape.logprobs
            else None
        )
    choice["finish_reason"] = finish_reason(meta) or "stop"
    if choice["finish_reason"] == "stop" and choice.get("message", {}).get("tool_calls"):
        choice["finish_reason"] = "tool_calls"
    choice["stop_reason"] = stop_reason(meta, shape.stop_token_ids)
    return choice


def completion(
    shape: Shape, native: dict, cached: int | None, choices: list[dict] | None = None
) -> dict:
    """The whole OpenAI answer (chat.completion or text_completion) of a native answer; `choices`
    (n > 1, router/openai_api/n_choices.py): every choice, and `native` carries the summed usage."""
    meta = native.get("meta_info") or {}
    obj = "chat.completion" if shape.kind == "chat" else "text_completion"
    return {
        "id": shape.rid,
        "object": obj,
        "created": shape.created,
        "model": shape.model,
        "choices": choices if choices is not None else [answer_choice(shape, native)],
        "usage": usage(meta, cached),
    }


class StreamShaper:
    """Turns native stream chunks into OpenAI SSE chunks for one request.

    `chunks(event)` returns the SSE strings for one native chunk (raises NodeAborted on an error
    chunk); `tail(cached)` the usage chunk (when asked for) and `[DONE]`; `error(msg)` an error
    event.
    """

    def __init__(self, shape: Shape, index: int = 0):
        assert shape.kind in ("chat", "completion"), shape.kind
        self.shape = shape
        self.index = index  # the choice (n > 1, router/openai_api/n_choices.py)
        self.started = False
        self.meta: dict = {}
        self.text_len = 0  # characters of the logprob tokens so far (text_offset)
        self.tools = shape.tools.stream() if shape.tools else None  # router/tools/stream.py

    def _deltas(self, text: str, final: bool) -> list[dict]:
        """The chat deltas of a piece of text (at least one, maybe empty): content, or, with
        tools, content and tool-call deltas."""
        if self.tools is None:
            return [{"content": text} if text else {}]
        return self.tools.feed(text, final) or [{}]

    def _frame(self, choice: dict) -> bytes:
        s = self.shape
        obj = "chat.completion.chunk" if s.kind == "chat" else "text_completion"
        out = {
            "id": s.rid,
            "object": obj,
            "created": s.created,
            "model": s.model,
            "choices": [choice],
        }
        if s.include_usage:
            out["usage"] = None
        return sse(out)

    def chunks(self, event: dict) -> list[bytes]:
        check_event(event)
        meta = event.get("meta_info") or {}
        self.meta.update(
            {k: v for k, v in meta.items() if k in ("prompt_tokens", "completion_tokens")}
        )
        text = event.get("text") or ""
        reason = finish_reason(meta)
        stop = stop_reason(meta, self.shape.stop_token_ids)
        entries = meta.get("logprobs") if self.shape.logprobs else None
        out = []
        if self.shape.kind == "chat":
            if not self.started:
                out.append(
                    self._frame(
                        {
                            "index": self.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                            "stop_reason": None,
                        }
                    )
                )
            if text or reason or entries:
                *before, delta = self._deltas(text, reason is not None)
                out += [self._frame(_chat_choice(d)) for d in before]
                if reason == "stop" and self.tools and self.tools.called:
                    reason = "tool_calls"
                out.append(
                    self._frame(
                        {
                            "index": self.index,
                            "delta": delta,
                            "logprobs": chat_logprobs(entries, self.shape.tokens_as_ids),
                            "finish_reason": reason,
                            "stop_reason": stop,
                        }
                    )
                )
        elif text or reason or entries:
            out.append(
                self._frame(
                    {
                        "index": self.index,
                        "text": text,
                        "logprobs": completion_logprobs(
                            entries, self.text_len, self.shape.tokens_as_ids
                        ),
                        "finish_reason": reason,
                        "stop_reason": stop,
                    }
                )
            )
        self.text_len += sum(len(_token(e, 3)[0]) for e in entries or ())
        self.started = True
        return out

    def tail(self, cached: int | None) -> list[bytes]:
        out, s = [], self.shape
        if s.include_usage:
            obj = "chat.completion.chunk" if s.kind == "chat" else "text_completion"
            out.append(
                sse(
                    {
                        "id": s.rid,
                        "object": obj,
                        "created": s.created,
                        "model": s.model,
                        "choices": [],
                        "usage": usage(self.meta, cached),
                    }
                )
            )
        out.append(sse("[DONE]"))
        return out

    @staticmethod
    def error(message: str, code: str = "node_aborted") -> list[bytes]:
        return [
            sse(
                {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
            ),
            sse("[DONE]"),
        ]


def _chat_choice(delta: dict) -> dict:
    return {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": None,
        "stop_reason": None,
    }


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
