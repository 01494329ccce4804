"""A chat body rendered by the model's chat template: the messages (tool conversations included),
the `tools` the template is given, and the tool-call format the template teaches the model.

A message is {role, content} with content a string (null for an assistant message that only calls
tools), plus `tool_calls` ([{id, type: "function", function: {name, arguments}}], assistant) or
`tool_call_id` (role "tool"). As vLLM does, a call's `arguments` (JSON text on the wire) reach the
template as an object, which is what the Llama 3 and Qwen templates print with `tojson`.

`tool_call_format(tok)` names the family format a template uses (docs/ROUTER.md, "Tools"); the
node reports it in /server_info and the router parses answers with it. None: the template has no
tool support, and a body with `tools` is a 400.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.runtime.front.prompt import RequestError

MAX_TOOLS = 128
_MESSAGES_SHAPE = (
    "'messages' must be a non-empty list of {role, content} strings (content may be null on an "
    "assistant message with tool_calls; tool_calls and tool_call_id as OpenAI's)"
)


def tool_call_format(tok: Any) -> str | None:
    """The tool-call format of the tokenizer's chat template, found from its text: `hermes`
    (<tool_call> JSON </tool_call>, Qwen2.5/Qwen3), `mistral` ([TOOL_CALLS] [...]),
    `llama3_json` ({"name", "parameters"}, Llama 3.1+); None when the template takes no tools."""
    template = getattr(tok, "chat_template", None)
    if isinstance(template, dict):  # named templates: the one for tools if there is one
        template = template.get("tool_use") or template.get("default")
    if not isinstance(template, str) or "tools" not in _variables(template):
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template and "parameters" in template:
        return "llama3_json"
    return None


def _variables(template: str) -> set[str]:
    from jinja2 import Environment, TemplateSyntaxError, meta

    try:
        return meta.find_undeclared_variables(Environment().parse(template))
    except TemplateSyntaxError:
        return set()


def _check_call(call: Any) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not (
        isinstance(call.get("id"), str)
        and call.get("type") == "function"
        and isinstance(fn, dict)
        and isinstance(fn.get("name"), str)
        and isinstance(fn.get("arguments"), str)
    ):
        raise RequestError(400, "a tool call is {id, type: function, function: {name, arguments}}")
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        args = fn["arguments"]  # not JSON: the template gets the text, as vLLM passes it
    return {
        "id": call["id"],
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }


def _message(m: Any, i: int) -> dict:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
        raise RequestError(400, _MESSAGES_SHAPE, "messages")
    calls = m.get("tool_calls")
    content = m.get("content")
    if not (isinstance(content, str) or (content is None and calls)):
        raise RequestError(400, _MESSAGES_SHAPE, f"messages.{i}.content")
    out = {"role": m["role"], "content": content or ""}
    if calls is not None:
        if m["role"] != "assistant" or not isinstance(calls, list):
            raise RequestError(400, "tool_calls: a list, on assistant messages", f"messages.{i}")
        try:
            out["tool_calls"] = [_check_call(c) for c in calls]
        except RequestError as e:
            raise RequestError(400, str(e), f"messages.{i}.tool_calls") from None
    if m.get("tool_call_id") is not None:
        if m["role"] != "tool" or not isinstance(m["tool_call_id"], str):
            raise RequestError(400, "tool_call_id: a string, on tool messages", f"messages.{i}")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def check_messages(body: dict[str, Any]) -> list[dict]:
    """A body's `messages` as the template takes them, or a 400 naming the bad one."""
    msgs = body["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise RequestError(400, _MESSAGES_SHAPE, "messages")
    return [_message(m, i) for i, m in enumerate(msgs)]


def check_tools(tok: Any, body: dict[str, Any]) -> list[dict] | None:
    """A body's `tools` (OpenAI's [{type: function, function: {name, ...}}]), None when absent."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not (
        isinstance(tools, list)
        and len(tools) <= MAX_TOOLS
        and all(
            isinstance(t, dict)
            and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
    ):
        raise RequestError(
            400, f"'tools' must be a list of at most {MAX_TOOLS} {{type: function, ...}}", "tools"
        )
    if tools and tool_call_format(tok) is None:
        raise RequestError(400, "tools: the model's chat template has no tool support", "tools")
    return tools or None


def render(tok: Any, body: dict[str, Any], add_generation_prompt: bool = True) -> str:
    """The chat template's text for a body with `messages` (and optional `tools`)."""
    from jinja2 import TemplateError

    msgs, tools = check_messages(body), check_tools(tok, body)
    if not tok.chat_template:  # a pretrained model (Gemma 3 270M): it has no chat format
        raise RequestError(
            400, "the model has no chat template: send its prompts to /v1/completions", "messages"
        )
    try:
        return tok.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except TemplateError as e:  # the template's own checks (roles must alternate, ...)
        raise RequestError(
            400, f"the model's chat template refused the messages: {e}", "messages"
        ) from None
