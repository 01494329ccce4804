"""The request models of tools (OpenAI's shapes): `tools`, `tool_choice`, and the `tool_calls` and
`tool_call_id` of chat messages. Strict, unknown fields refused, like router/openai_api/protocol.py
(which uses these as field types)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

FunctionName = Annotated[str, Field(strict=True, pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
MAX_TOOLS = 128  # the node's limit too (runtime/front/chat_template.py)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Strict):
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments; absent: any object"
    )
    strict: StrictBool | None = Field(
        None, description="accepted; calls forced by tool_choice always follow the schema"
    )


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionRef(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CallFunction(_Strict):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI's


class ToolCall(_Strict):
    """A call in an assistant message of the conversation."""

    id: StrictStr
    type: Literal["function"]
    function: CallFunction


_NONE = {"type": "null"}
# What a message's validators enforce, for the OpenAPI document: tool_calls only on an assistant
# message, tool_call_id only on a tool message.
MESSAGE_ROLES_SCHEMA = [
    {"properties": {"role": {"const": "assistant"}, "tool_call_id": _NONE}},
    {"properties": {"role": {"const": "tool"}, "tool_calls": _NONE}},
    {
        "properties": {
            "role": {"enum": ["system", "developer", "user"]},
            "tool_calls": _NONE,
            "tool_call_id": _NONE,
        }
    },
]
