"""OpenAI request models, their validation errors, and the translation to the native node request.

Types are strict (a string is not a number, a bool is not an int); unknown OpenAI fields are
ignored. Anything a client can get wrong becomes an `ApiError` with an OpenAI-style body.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError
from pydantic import field_validator

Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class ApiError(Exception):
    """An answer other than 200, with an OpenAI-style body `{"error": {...}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, body: dict | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.body = body or {"error": {"message": message, "type": type, "param": param,
                                       "code": code}}


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
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    # Extensions that nodes understand (SGLang names).
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[StrictInt] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

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
        params = {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
                  "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
                  "stop_token_ids": self.stop_token_ids, "ignore_eos": self.ignore_eos}
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
    messages: list[ChatMessage]
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


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)     # the OpenAI default for completions
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: StrictStr | None = None

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
        prompt = {"text": self.prompt} if isinstance(self.prompt, str) else {"input_ids": self.prompt}
        return {**prompt, "sampling_params": params}

    def prompt_key(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else " ".join(map(str, self.prompt))

    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal", "function-after"}


def parse_request(cls: type[_Common], body: Any) -> _Common:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = [str(p) for p in err["loc"]
               if not (isinstance(p, str) and ("[" in p or p.lower() in _TYPE_TAGS))]
        param = ".".join(loc) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param,
                       code="invalid_value") from None


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
    return {k: v for k, v in body.items()
            if k not in ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room")}


def native_prompt_key(body: dict[str, Any]) -> str:
    if isinstance(body.get("text"), str):
        return body["text"]
    if isinstance(body.get("messages"), list):
        return "".join(f"{m.get('role')}\n{m.get('content')}\n" for m in body["messages"]
                       if isinstance(m, dict))
    ids = body.get("input_ids")
    return " ".join(map(str, ids)) if isinstance(ids, list) else ""
