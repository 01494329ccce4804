"""Streamed tool calls: the chat deltas of one answer whose text may hold calls.

Each new piece of text is added to what came before and the whole is scanned again
(router/tools/parsers.py scan; answers are short, so this is cheap next to a token's forward pass).
What the scan shows beyond what was sent becomes deltas, as OpenAI streams them: content first;
for each call, one delta with its `index`, `id`, `type` and `function.name` (arguments ""), then
deltas with fragments of `function.arguments`. A call's deltas start once its name is known. If at
the end the calls' text does not parse, the text not yet sent goes out as content.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from pdserve.router.tools.parsers import scan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_json(index: int | None, cid: str, name: str, arguments: str) -> dict:
    call = {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


@dataclass
class ToolStream:
    fmt: str
    parallel: bool = True  # False: only the first call is answered (parallel_tool_calls)
    text: str = ""
    content_sent: int = 0  # characters of content sent
    args_sent: list[int] = field(default_factory=list)  # per call started: argument chars sent
    called: bool = False  # at least one call was sent

    def feed(self, piece: str, final: bool = False) -> list[dict]:
        """The deltas that `piece` (and, when `final`, the end of the answer) adds."""
        self.text += piece
        out = scan(self.fmt, self.text, final)
        if out.bad:
            rest, self.content_sent = self.text[self.content_sent :], len(self.text)
            return [{"content": rest}] if rest else []
        deltas = []
        if len(out.content) > self.content_sent:
            deltas.append({"content": out.content[self.content_sent :]})
            self.content_sent = len(out.content)
        calls = out.calls if self.parallel else out.calls[:1]
        for i, call in enumerate(calls):
            if call.name is None:
                break
            if i == len(self.args_sent):
                deltas.append({"tool_calls": [call_json(i, call_id(), call.name, "")]})
                self.args_sent.append(0)
                self.called = True
            fragment = call.arguments[self.args_sent[i] :]
            if fragment:
                fn = {"arguments": fragment}
                deltas.append({"tool_calls": [{"index": i, "function": fn}]})
                self.args_sent[i] = len(call.arguments)
        return deltas
