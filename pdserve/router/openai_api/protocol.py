"""OpenAI request models and their translation to the native node request.

Types are strict (router/openai_api/field_types.py). Every field is either implemented here or
listed in router/openai_api/unimplemented_fields.py, where it is accepted only at a neutral value;
anything else, unknown fields included, is a 400 naming the field
(router/openai_api/request_parsing.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pdserve.router.openai_api import unimplemented_fields
from pdserve.router.openai_api.field_types import (
    MAX_N,
    Float,
    Int64,
    ResponseFormat,
    StopText,
    StreamOptions,
    StrictModel,
    TokenId,
    TokenIdKey,
    document_unsupported,
)
from pdserve.router.tools.models import (
    MAX_TOOLS,
    MESSAGE_ROLES_SCHEMA,
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
)

_MODEL_DEFAULT = "absent: the model's generation_config value, else {}"


class _Common(StrictModel):
    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1, description="absent: the rest of the context")
    temperature: Float | None = Field(None, ge=0.0, le=2.0, description=_MODEL_DEFAULT.format(1))
    top_p: Float | None = Field(None, gt=0.0, le=1.0, description=_MODEL_DEFAULT.format(1))
    seed: Int64 | None = Field(None, ge=0, description="choice i of n samples with seed + i")
    n: StrictInt | None = Field(
        None, ge=1, le=MAX_N, description="choices (router/openai_api/n_choices.py)"
    )
    best_of: StrictInt | None = Field(
        None, ge=1, le=MAX_N, description="vLLM's; only equal to n (no ranking)"
    )
    stop: StopText | list[StopText] | None = Field(None, json_schema_extra={"maxItems": 16})
    # Accepted and not used, as by vLLM: end-user ids for a provider's abuse monitoring.
    user: StrictStr | None = Field(None, description="accepted, not used")
    safety_identifier: StrictStr | None = Field(None, description="accepted, not used")
    # vLLM's: lower runs earlier; the router's admission queue orders by it (router/admission.py)
    priority: StrictInt | None = Field(None, ge=-(2**31), lt=2**31, description="lower first")
    # Extensions that nodes understand (vLLM's and SGLang's names).
    top_k: Int64 | None = Field(
        None,
        ge=-1,
        json_schema_extra={"not": {"const": 0}},
        description=_MODEL_DEFAULT.format("-1 (off)"),
    )
    min_p: Float | None = Field(None, ge=0.0, le=1.0, description=_MODEL_DEFAULT.format(0))
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[TokenId] | None = None
    return_tokens_as_token_ids: StrictBool | None = Field(
        None, description="logprob tokens as 'token_id:<id>' (vLLM's)"
    )
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Float | None = Field(None, gt=0.0, le=10.0, description="vLLM's")
    logit_bias: dict[TokenIdKey, Annotated[float, Field(strict=False, ge=-100, le=100)]] | None = (
        Field(
            None,
            json_schema_extra={
                "maxProperties": 300,
                "propertyNames": {"pattern": "^[0-9]{1,9}$"},
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            },
        )
    )

    # Structured output: OpenAI's response_format, and vLLM's guided_* extensions (one at most).
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = Field(None, max_length=4096)
    guided_choice: list[Annotated[str, Field(strict=True, min_length=1)]] | None = Field(
        None, min_length=1, max_length=256
    )

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        if v is not None:
            if len(v) > 300:
                raise ValueError("at most 300 tokens")
            for k in v:
                if not k.isdigit() or int(k) >= 2**31:
                    raise ValueError(f"keys are token ids, got {k!r}")
        return v

    @model_validator(mode="after")
    def _one_guide(self):
        given = [
            n
            for n in ("response_format", "guided_json", "guided_regex", "guided_choice")
            if getattr(self, n) is not None
            and not (n == "response_format" and self.response_format.type == "text")
        ]
        if len(given) > 1:
            raise PydanticCustomError(
                "invalid_value", "at most one of {fields}", {"fields": ", ".join(given)}
            )
        return self

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n") or 1
        if v is not None and v != n:
            raise ValueError(f"must equal n ({n}): choices are not ranked by logprob here")
        return v

    def guide_field(self) -> str | None:
        """The client's field that gave the node's `guide` (a bad guide's 400 names it)."""
        rf = self.response_format
        if rf is not None and rf.type != "text":
            return "response_format"
        names = ("guided_json", "guided_regex", "guided_choice")
        return next((n for n in names if getattr(self, n) is not None), None)

    def _guide(self) -> list[str] | None:
        """The node's `guide` (engine/grammar.py): [kind, spec]."""
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            return ["json_object", ""]
        if rf is not None and rf.type == "json_schema":
            return ["json_schema", json.dumps(rf.json_schema.schema_)]
        if self.guided_json is not None:
            spec = self.guided_json
            return ["json_schema", spec if isinstance(spec, str) else json.dumps(spec)]
        if self.guided_regex is not None:
            return ["regex", self.guided_regex]
        if self.guided_choice is not None:
            return ["choice", json.dumps(self.guided_choice)]
        return None

    @field_validator("top_k")
    @classmethod
    def _top_k_on_or_off(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences")
        return v

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling(self, max_tokens: int | None) -> dict[str, Any]:
        # null asks the node for the model's default, as vLLM does for an absent OpenAI field: the
        # model's generation_config value, else temperature 1 and no top-p/top-k/min-p filter; for
        # max_tokens, the rest of the context (docs/PROTOCOL.md)
        params = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
        }
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        given = {
            "seed": self.seed,
            "stop": stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias or None,
            "guide": self._guide(),
        }
        return {**params, **{k: v for k, v in given.items() if v is not None}}


class ContentPart(StrictModel):
    type: Literal["text"]
    text: StrictStr


def _document_message(schema: dict[str, Any], cls: type[StrictModel]) -> None:
    document_unsupported(schema, cls)
    schema["anyOf"] = MESSAGE_ROLES_SCHEMA


class ChatMessage(StrictModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_document_message)
    UNSUPPORTED = unimplemented_fields.MESSAGE
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: StrictStr | None = None  # tool

    @field_validator("tool_calls", "tool_call_id")
    @classmethod
    def _fits_the_role(cls, v, info: ValidationInfo):
        role = "assistant" if info.field_name == "tool_calls" else "tool"
        if v is not None and info.data.get("role") != role:
            raise ValueError(f"only on {role} messages")
        return v

    def native(self) -> dict[str, Any]:
        """The node's message (runtime/front/chat_template.py): content as one string."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["content"] = self.text() if self.content is not None else None
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    """A chat completion request. Fields listed with an `enum` and "not supported" are accepted
    only at those values; any other value, or an unknown field, is a 400 unsupported_parameter."""

    UNSUPPORTED = unimplemented_fields.CHAT
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: StrictInt | None = Field(
        None, ge=1, description="absent: the rest of the context"
    )
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    # Tools (router/tools/request.py): parsed per the model's format, forced by `required` or a
    # name.
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(None, description="absent: auto")
    parallel_tool_calls: StrictBool | None = Field(None, description="absent: true")

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info: ValidationInfo):
        names = [t.function.name for t in info.data.get("tools") or ()]
        if v == "required" and not names:
            raise ValueError("'required' needs tools")
        if isinstance(v, NamedToolChoice) and v.function.name not in names:
            raise ValueError(f"function {v.function.name!r} is not one of the tools")
        return v

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def to_native(self) -> dict[str, Any]:
        params = self._sampling(self.max_new_tokens())
        if self.logprobs:
            params["logprobs"] = True
            params["top_logprobs"] = self.top_logprobs or 0
        messages = [m.native() for m in self.messages]
        return {"messages": messages, "sampling_params": params}

    def prompt_key(self) -> str:
        return "".join(f"{m.role}\n{m.text()}\n" for m in self.messages)

    def wants_logprobs(self) -> bool:
        return self.logprobs


TOKEN_IDS_SCHEMA = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
}
_PROMPT_SCHEMA = [  # one non-empty prompt: text, [text], token ids or [token ids]
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1},
    TOKEN_IDS_SCHEMA,
    {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": 1},
]


class CompletionRequest(_Common):
    """A text completion request. Fields listed with an `enum` and "not supported" are accepted
    only at those values; any other value, or an unknown field, is a 400 unsupported_parameter."""

    UNSUPPORTED = unimplemented_fields.COMPLETION
    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]] = Field(
        json_schema_extra=lambda s: s.update(anyOf=_PROMPT_SCHEMA)
    )
    max_tokens: StrictInt | None = Field(
        16,
        ge=1,  # the OpenAI default for completions
        description="null: the rest of the context",
    )
    logprobs: StrictInt | None = Field(None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    def to_native(self) -> dict[str, Any]:
        params = self._sampling(self.max_tokens)
        if self.logprobs is not None:
            params["logprobs"] = True
            params["top_logprobs"] = self.logprobs
        prompt = (
            {"text": self.prompt} if isinstance(self.prompt, str) else {"input_ids": self.prompt}
        )
        return {**prompt, "sampling_params": params}

    def prompt_key(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else " ".join(map(str, self.prompt))

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None
