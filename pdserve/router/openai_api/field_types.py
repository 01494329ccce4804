"""The strict building blocks of the OpenAI request models (router/openai_api/protocol.py): field
types (a string is not a number, a bool is not an int), `StrictModel` (unknown fields refused, the
fields of router/openai_api/unimplemented_fields.py accepted only at a neutral value) and the small
nested objects."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, model_validator
from pydantic_core import PydanticCustomError

from pdserve.router.openai_api import unimplemented_fields
from pdserve.router.openai_api.unimplemented_fields import UNSUPPORTED_CODE

MAX_N = 16  # choices per request (`n`)
Float = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Int64 = Annotated[int, Field(strict=True, lt=2**63)]  # nodes pass ints on as msgpack int64
StopText = Annotated[str, Field(strict=True, min_length=1)]
TokenId = Annotated[int, Field(strict=True, ge=0, lt=2**63)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]  # logit_bias keys: token ids as text

# `json_schema_extra` below states in the OpenAPI document (router/openai_api/openapi.py) what a
# validator enforces, so that a client (or a fuzzer) reading the document knows which values are
# accepted.


def document_unsupported(schema: dict[str, Any], cls: type[StrictModel]) -> None:
    for name, neutral in cls.UNSUPPORTED.items():
        schema.setdefault("properties", {})[name] = unimplemented_fields.schema(neutral)


class StrictModel(BaseModel):
    """Unknown fields are refused; `UNSUPPORTED` fields are dropped at a neutral value and refused
    at any other (router/openai_api/unimplemented_fields.py)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=document_unsupported)
    UNSUPPORTED: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not cls.UNSUPPORTED:
            return data
        for key, value in data.items():
            neutral = cls.UNSUPPORTED.get(key)
            if neutral is not None and not unimplemented_fields.is_neutral(value, neutral):
                raise PydanticCustomError(
                    UNSUPPORTED_CODE,
                    "not supported by this server (send {values}, or leave it out)",
                    {"field": key, "values": unimplemented_fields.describe(neutral)},
                )
        return {k: v for k, v in data.items() if k not in cls.UNSUPPORTED}


class JsonSchemaFormat(StrictModel):
    name: StrictStr = Field(max_length=64)
    description: StrictStr | None = None
    # `schema` shadows a BaseModel attribute: stored as schema_, sent and documented as "schema"
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class StreamOptions(StrictModel):
    UNSUPPORTED = unimplemented_fields.STREAM_OPTIONS
    include_usage: StrictBool = False
