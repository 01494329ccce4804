"""OpenAI request models, their validation errors, and the translation to the native node request.

Types are strict (a string is not a number, a bool is not an int); unknown OpenAI fields are
ignored. Anything a client can get wrong becomes an `ApiError` with an OpenAI-style body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
)

Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Int64 = Annotated[int, Field(strict=True, lt=2**63)]  # nodes pass ints on as msgpack int64
StopText = Annotated[str, Field(strict=True, min_length=1)]
TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**63)]

# `json_schema_extra` below states in the OpenAPI document (router/openapi.py) what a validator
# enforces, so that a client (or a fuzzer) reading the document knows which values are accepted.


class ApiError(Exception):
    """An answer other than 200, with an OpenAI-style body `{"error": {...}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        body: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.body = body or {
            "error": {"message": message, "type": type, "param": param, "code": code}
        }


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Model):
    include_usage: StrictBool = False


class _Common(_Model):
    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    seed: Int64 | None = Field(None, ge=0)
    stop: StopText | list[StopText] | None = Field(None, json_schema_extra={"maxItems": 16})
    n: StrictInt = Field(1, json_schema_extra={"const": 1})
    presence_penalty: Float | None = Field(None, json_schema_extra={"enum": [0, None]})
    frequency_penalty: Float | None = Field(None, json_schema_extra={"enum": [0, None]})
    # Extensions that nodes understand (SGLang names).
    top_k: Int64 | None = Field(None, ge=-1, json_schema_extra={"not": {"const": 0}})
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[TokenId] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("top_k")
    @classmethod
    def _top_k_on_or_off(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v not in (None, 0.0):
            raise ValueError("presence/frequency penalties are not supported; send 0 or omit")
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
        params = {
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
        }
        return {k: v for k, v in params.items() if v is not None}


class ContentPart(_Model):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def to_native(self) -> dict[str, Any]:
        params = self._sampling(self.max_new_tokens())
        if self.logprobs:
            params["logprobs"] = True
            params["top_logprobs"] = self.top_logprobs or 0
        messages = [{"role": m.role, "content": m.text()} for m in self.messages]
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
    prompt: StrictStr | list[StrictStr] | list[TokenId] | list[list[TokenId]] = Field(
        json_schema_extra=lambda s: s.update(anyOf=_PROMPT_SCHEMA)
    )
    max_tokens: StrictInt | None = Field(16, ge=1)  # the OpenAI default for completions
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = Field(False, json_schema_extra={"const": False})
    suffix: StrictStr | None = Field(None, json_schema_extra={"maxLength": 0})

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

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v):
        if v:
            raise ValueError("suffix is not supported")
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


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "function-after"}


def _is_tag(part: Any) -> bool:
    """A union branch or validator name pydantic puts in a location (`str`, `list[int]`,
    `constrained-str`); field names never hold '[' or '-'."""
    return isinstance(part, str) and ("[" in part or "-" in part or part.lower() in _TYPE_TAGS)


def _most_telling(errors: list[dict]) -> dict:
    """Of the errors about the first bad field, the one that says most: for a union, a value
    error in the branch of the right type (`prompt.0: >= 0`) beats "should be a valid string"."""
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    return min(same, key=lambda e: (e["type"].endswith("_type"), -len(e["loc"])))


def parse_request(cls: type[_Common], body: Any) -> _Common:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = _most_telling(exc.errors(include_url=False))
        param = ".".join(str(p) for p in err["loc"] if not _is_tag(p)) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(
            400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value"
        ) from None


def parse_native(body: Any) -> dict[str, Any]:
    """Checks on a native `/generate` body: an object with exactly one prompt field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompts = [k for k in ("text", "messages", "input_ids") if k in body]
    if len(prompts) != 1:
        raise ApiError(400, "give exactly one of text, messages, input_ids", param="text")
    if "sampling_params" in body and not isinstance(body["sampling_params"], dict):
        raise ApiError(400, "sampling_params must be an object", param="sampling_params")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ApiError(400, "stream must be a boolean", param="stream")
    return {
        k: v
        for k, v in body.items()
        if k not in ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room")
    }


def native_prompt_key(body: dict[str, Any]) -> str:
    if isinstance(body.get("text"), str):
        return body["text"]
    if isinstance(body.get("messages"), list):
        return "".join(
            f"{m.get('role')}\n{m.get('content')}\n"
            for m in body["messages"]
            if isinstance(m, dict)
        )
    ids = body.get("input_ids")
    return " ".join(map(str, ids)) if isinstance(ids, list) else ""
