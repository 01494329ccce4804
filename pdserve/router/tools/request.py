"""Tools on a chat request: what the node is sent, the guide that forces a call, and the answer.

The node renders `tools` with its chat template and reports its model's tool-call format in
/server_info (runtime/front/chat_template.py); the router parses the answer's text in that format
(router/tools/parsers.py), whole or streamed (router/tools/stream.py). Why the router parses is in
docs/ROUTER.md, "Tools".

tool_choice:
    none      the tools are not rendered and the answer is not parsed (OpenAI: no call is made)
    auto      the tools are rendered; calls in the answer are parsed
    required  as auto, and the answer is forced to be one or more calls in the family's format
    {function: {name}}  as required, with exactly one call, of that function

Forcing uses a `structural_tag` guide (engine/grammar.py, xgrammar): calls `begin args end`
separated by `separator`, where `begin` holds the function's name and `args` follows the
function's JSON Schema, at least one, only the first when parallel_tool_calls is false or a
function is named. The answer is then nothing but calls, so even a random model gives a valid one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pdserve.router.errors import ApiError
from pdserve.router.openai_api.protocol import ChatRequest
from pdserve.router.tools.models import NamedToolChoice
from pdserve.router.tools.parsers import parse
from pdserve.router.tools.stream import ToolStream, call_id, call_json

# format -> (text before the calls, a call's begin (with its name), its end, separator, after)
_FORCED = {
    "hermes": ("", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n", ""),
    "llama3_json": ("", '{{"name": {name}, "parameters": ', "}", "; ", ""),
    "mistral": ("[TOOL_CALLS][", '{{"name": {name}, "arguments": ', "}", ", ", "]"),
}
ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How one request's answer is read: the model's tool-call format, and whether more than one
    call is answered."""

    fmt: str
    parallel: bool = True

    def message(self, text: str) -> dict[str, Any]:
        """The assistant message of a whole answer: content, and tool_calls when it made any."""
        content, calls = parse(self.fmt, text)
        if not calls:
            return {"role": "assistant", "content": text}
        calls = calls if self.parallel else calls[:1]
        return {
            "role": "assistant",
            "content": content,
            "tool_calls": [call_json(None, call_id(), c.name, c.arguments) for c in calls],
        }

    def stream(self) -> ToolStream:
        return ToolStream(self.fmt, self.parallel)


def structural_tag(fmt: str, tools: list, parallel: bool) -> dict[str, Any]:
    """xgrammar's structural tag that admits only calls of `tools` in format `fmt`."""
    before, begin, end, sep, after = _FORCED[fmt]
    tags = [
        {
            "type": "tag",
            "begin": begin.format(name=json.dumps(t.function.name)),
            "content": {
                "type": "json_schema",
                "json_schema": t.function.parameters or ANY_OBJECT,
                "max_whitespace_cnt": 1,
            },
            "end": end,
        }
        for t in tools
    ]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": sep,
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
    if before or after:
        calls = {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": before},
                calls,
                {"type": "const_string", "value": after},
            ],
        }
    return {"type": "structural_tag", "format": calls}


def apply(req: ChatRequest, native: dict[str, Any], fmt: str | None) -> ToolPlan | None:
    """Puts the request's tools (and, for a forced call, its guide) into the node's body `native`;
    the plan for its answer, None when it has no tools to call. `fmt`: the model's format."""
    if not req.tools:
        return None
    if fmt is None:
        raise ApiError(
            400,
            "tools: the model's chat template has no tool support",
            param="tools",
            code="invalid_value",
        )
    choice = req.tool_choice or "auto"
    if choice == "none":
        return None
    native["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    named = isinstance(choice, NamedToolChoice)
    parallel = req.parallel_tool_calls is not False and not named
    if choice == "required" or named:
        params = native["sampling_params"]
        if "guide" in params:
            raise ApiError(
                400,
                "tool_choice: a forced call cannot be combined with response_format or guided_*",
                param="tool_choice",
                code="invalid_value",
            )
        tools = [t for t in req.tools if not named or t.function.name == choice.function.name]
        params["guide"] = ["structural_tag", json.dumps(structural_tag(fmt, tools, parallel))]
    return ToolPlan(fmt, parallel)
