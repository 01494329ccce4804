"""Tool calls out of a model's text, one parser per family format (pure text: the router has no
tokenizer). The node names its model's format in /server_info (runtime/front/chat_template.py):

    hermes       Qwen2.5 / Qwen3   text <tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>
    llama3_json  Llama 3.1+        {"name": .., "parameters": {..}}; {..}   (the whole answer)
    mistral      Mistral           text [TOOL_CALLS][{"name": .., "arguments": {..}}, ...]

vLLM's llama3_json, hermes and mistral parsers define the formats; this is not their code.
`scan(fmt, text, final)` reads what there is so far: the content before the calls, and each call's
name and its arguments' JSON text up to where it has been generated (a prefix of the final text),
so a stream can send a call's name as soon as it is known and its arguments as they grow
(router/tools/stream.py). A call's `arguments` is its raw JSON text, the same streamed and whole.
When the text of the calls does not parse, the answer is all content and no calls, as vLLM does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

FORMATS = ("hermes", "llama3_json", "mistral")
_WS = re.compile(r"\s*")
_SCALAR = re.compile(r"-?[0-9][0-9.eE+\-]*|true|false|null")


class _Bad(Exception):
    """The calls' text does not parse."""


@dataclass
class Call:
    name: str | None = None
    arguments: str = ""  # JSON text so far
    done: bool = False


@dataclass
class Scan:
    content: str  # text before the calls; in a stream, without a held-back start of a marker
    calls: list[Call] = field(default_factory=list)
    bad: bool = False  # the calls' text does not parse: it is all content


def _held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could start `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _value_end(text: str, i: int) -> int | None:
    """Index after the JSON value at `i`; None if the text ends inside it; _Bad if it cannot be."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
            elif text[j] == '"':
                return j + 1
            else:
                j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(text):
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = _SCALAR.match(text, i)
    if not m:
        raise _Bad
    return m.end() if m.end() < len(text) else None


def _skip(text: str, i: int) -> int:
    return _WS.match(text, i).end()


def _call(text: str, i: int) -> tuple[Call, int | None]:
    """The call object at `i` ({"name", "arguments" or "parameters"}, keys in any order): the call
    so far and the index after it (None while it is incomplete)."""
    call = Call()
    if i >= len(text):
        return call, None
    if text[i] != "{":
        raise _Bad
    i = _skip(text, i + 1)
    while i < len(text) and text[i] != "}":
        key_end = _value_end(text, i)
        if key_end is None:
            return call, None
        if text[i] != '"':
            raise _Bad
        key = json.loads(text[i:key_end])
        i = _skip(text, key_end)
        if i >= len(text):
            return call, None
        if text[i] != ":":
            raise _Bad
        i = _skip(text, i + 1)
        end = _value_end(text, i)
        if key in ("arguments", "parameters"):
            if i < len(text) and text[i] != "{":
                raise _Bad
            call.arguments = text[i : len(text) if end is None else end]
        if end is None:
            return call, None
        if key == "name":
            call.name = json.loads(text[i:end])
            if not isinstance(call.name, str):
                raise _Bad
        i = _skip(text, end)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
    if i >= len(text):
        return call, None
    if call.name is None:
        raise _Bad
    try:
        args = json.loads(call.arguments or "{}")
    except ValueError:
        raise _Bad from None
    if not isinstance(args, dict):
        raise _Bad
    call.arguments, call.done = call.arguments or "{}", True
    return call, i + 1


def _calls(text: str, i: int, sep: str, close: str, begin: str = "", end: str = "") -> list[Call]:
    """Calls from `i` on: [begin] object [end], separated by `sep`, up to `close` or the text's end
    (begin/end: each call's wrapper, as hermes's <tool_call> .. </tool_call>)."""
    calls: list[Call] = []
    while True:
        i = _skip(text, i)
        if begin:
            if not text.startswith(begin, i):  # the end, or text after the calls: not a call
                return calls
            i = _skip(text, i + len(begin))
        call, after = _call(text, i)
        if call.name is not None or call.arguments or after is not None:
            calls.append(call)
        if after is None:
            return calls
        i = _skip(text, after)
        for token in (end, sep):
            if token and text.startswith(token, i):
                i = _skip(text, i + len(token))
            elif token and token.startswith(text[i:]):
                return calls
            elif token == end and end:
                raise _Bad
        if i >= len(text) or (close and text.startswith(close, i)):
            return calls
        if not sep and not begin:
            raise _Bad


def _scan(fmt: str, text: str, final: bool) -> Scan:
    if fmt == "llama3_json":
        start = _skip(text, 0)
        body = text[start:].removeprefix("<|python_tag|>")
        if not body:
            return Scan("" if not final else text)
        if not body.startswith("{"):
            return Scan(text)
        return Scan("", _calls(body, 0, ";", ""))
    marker = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}[fmt]
    at = text.find(marker)
    if at < 0:
        return Scan(text if final else text[: len(text) - _held(text, marker)])
    if fmt == "hermes":
        calls = _calls(text, at, "", "", "<tool_call>", "</tool_call>")
    else:
        i = _skip(text, at + len(marker))
        if i < len(text) and text[i] != "[":
            raise _Bad
        calls = _calls(text, i + 1, ",", "]") if i < len(text) else []
    return Scan(text[:at], calls)


def scan(fmt: str, text: str, final: bool = False) -> Scan:
    """What `text` holds so far; `final`: the answer is complete, so an unfinished call is bad."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool-call format {fmt!r}; known: {', '.join(FORMATS)}")
    try:
        out = _scan(fmt, text, final)
    except _Bad:
        return Scan(text, bad=True)
    if final and (any(not c.done for c in out.calls) or (out.calls == [] and out.content != text)):
        return Scan(text, bad=True)
    return out


def parse(fmt: str, text: str) -> tuple[str | None, list[Call]]:
    """A whole answer: (content, or None when it is only calls; the calls)."""
    out = scan(fmt, text, final=True)
    content = out.content if out.content.strip() or not out.calls else None
    return content, out.calls
