"""The router's OpenAPI 3.1 document for its public API, served at `GET /openapi.json`.

The OpenAI request bodies are the pydantic models of router/openai_protocol.py (their validators'
rules are stated there with `json_schema_extra`). The native `/generate` body follows the node's
rules (engine/core.py `SamplingParams`, docs/PROTOCOL.md). Responses are written out here.
Three facts are only known at run time and go in per call: the served model names (`model` enum),
the smallest node context (largest `max_tokens`), and whether any served model takes tools (if
none does, `tools` is only `[]` and `tool_choice` only `none` or `auto`).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from router.openai_protocol import TOKEN_IDS_SCHEMA, ChatRequest, CompletionRequest
from router.openai_types import MAX_N
from router.tokenize import Detokenize, TokenizeChat, TokenizePrompt

_REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(model=name)}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


_INT64 = {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}
_STOP_TEXT = {"type": "string", "minLength": 1}

_MODEL_DEFAULT = (
    "absent: the native default (greedy, no filter); null: the model's "
    "generation_config value, else temperature 1 and no filter"
)
# Node-side rules for the native sampling parameters (engine/core.py SamplingParams.validate).
_NATIVE_SAMPLING = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "max_tokens": {
            "anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}],
            "description": "absent: 128; null: the rest of the context",
        },
        "temperature": {
            "anyOf": [{"type": "number", "minimum": 0, "maximum": 100}, {"type": "null"}],
            "description": _MODEL_DEFAULT,
        },
        "top_p": {
            "anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1}, {"type": "null"}],
            "description": _MODEL_DEFAULT,
        },
        "top_k": {
            "anyOf": [
                {"const": -1},
                {"type": "integer", "minimum": 1, "maximum": 2**63 - 1},
                {"type": "null"},
            ],
            "description": _MODEL_DEFAULT,
        },
        "min_p": {
            "anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}],
            "description": _MODEL_DEFAULT,
        },
        "seed": _nullable(_INT64),
        "stop": {
            "anyOf": [
                _STOP_TEXT,
                {"type": "array", "items": _STOP_TEXT, "maxItems": 16},
                {"type": "null"},
            ]
        },
        "stop_token_ids": _nullable({"type": "array", "items": _INT64}),
        "ignore_eos": {"type": "boolean"},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    },
    # top_logprobs > 0 needs logprobs: true
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"minimum": 1}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}
_NATIVE_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
}
_GENERATE_REQUEST = {
    "type": "object",
    "description": "Exactly one of text, messages, input_ids. Other fields are passed to the "
    "nodes, which ignore what they do not know (rid and bootstrap_* are the "
    "router's own and are replaced).",
    "properties": {
        "text": {"type": "string", "minLength": 1},
        "messages": {"type": "array", "items": _NATIVE_MESSAGE, "minItems": 1},
        "input_ids": TOKEN_IDS_SCHEMA,
        "sampling_params": _ref("SamplingParams"),
        "stream": {"type": "boolean"},
        "model": {
            "type": "string",
            "description": "routes the request to the nodes of this "
            "model; required when several are served",
        },
    },
    "oneOf": [{"required": ["text"]}, {"required": ["messages"]}, {"required": ["input_ids"]}],
}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        **{
            k: {"type": "integer", "minimum": 0}
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
        "prompt_tokens_details": {
            "description": "cached_tokens: prompt tokens the prefix cache held "
            "(on a PD pair, the prefill node's); null if unknown",
            "anyOf": [
                {
                    "type": "object",
                    "required": ["cached_tokens"],
                    "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
                },
                {"type": "null"},
            ],
        },
    },
}
_FINISH = {"enum": ["stop", "length"]}
_STOP_REASON = {
    "type": ["string", "integer", "null"],
    "description": "the stop string or stop token id that ended the answer (vLLM's "
    "field); null at length or at the model's EOS",
}


_INDEX = {
    "type": "integer",
    "minimum": 0,
    "maximum": MAX_N - 1,
    "description": "the choice, 0..n-1",
}
_TOOL_CALL = {
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name", "arguments"],
            "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
        },
    },
}
_NO_TOOLS = {
    "tools": {
        "anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}],
        "description": "no served model's chat template takes tools",
    },
    "tool_choice": {"enum": ["none", "auto", None], "description": "no tools to call"},
}


def _completion(obj: str, choice: dict) -> dict:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "minItems": 1, "maxItems": MAX_N, "items": choice},
            "usage": _USAGE,
        },
    }


_CHAT_COMPLETION = _completion(
    "chat.completion",
    {
        "type": "object",
        "required": ["index", "message", "logprobs", "finish_reason"],
        "properties": {
            "index": _INDEX,
            "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
            "stop_reason": _STOP_REASON,
            "logprobs": {"type": ["object", "null"]},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {
                    "role": {"const": "assistant"},
                    "content": {"type": ["string", "null"], "description": "null: only calls"},
                    "tool_calls": {"type": "array", "items": _TOOL_CALL},
                },
            },
        },
    },
)
_TEXT_COMPLETION = _completion(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "logprobs", "finish_reason"],
        "properties": {
            "index": _INDEX,
            "text": {"type": "string"},
            "finish_reason": _FINISH,
            "stop_reason": _STOP_REASON,
            "logprobs": {"type": ["object", "null"]},
        },
    },
)
_NATIVE_ANSWER = {
    "type": "object",
    "required": ["text", "token_ids", "meta_info"],
    "properties": {
        "rid": {"type": "string"},
        "text": {"type": "string"},
        "token_ids": {"type": "array", "items": {"type": "integer"}},
        "meta_info": {"type": "object"},
    },
}
_MODEL_LIST = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object", "created", "owned_by"],
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                    "max_model_len": {"type": ["integer", "null"]},
                },
            },
        },
    },
}
_HEALTH = {
    "type": "object",
    "required": ["status", "workers"],
    "properties": {"status": {"enum": ["ok", "unavailable"]}, "workers": {"type": "object"}},
}

_ERRORS = {
    "400": "invalid request: `param` names the field",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "body larger than --max-body-bytes",
    "415": "Content-Type is not JSON",
    "429": "the router is at capacity (Retry-After)",
    "502": "a node failed",
    "503": "no eligible worker",
    "504": "no answer within --request-timeout",
}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref("Error")}}}


def _generation(summary: str, request: str, answer: str) -> dict:
    # Before OpenAPI 3.2 (`itemSchema`), an event-stream's `schema` describes one event.
    sse = {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {"data": {"type": "string"}},
            "description": "`data: {json chunk}` events, the last one `data: [DONE]`",
        }
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": "the answer, or an SSE stream when `stream` is true",
                    "content": {
                        "application/json": {"schema": _ref(answer)},
                        "text/event-stream": sse,
                    },
                },
                **{code: _error(why) for code, why in _ERRORS.items()},
            },
        }
    }


_TOKENIZE_ANSWER = {
    "type": "object",
    "required": ["count", "max_model_len", "tokens", "token_strs"],
    "properties": {
        "count": {"type": "integer", "minimum": 0},
        "max_model_len": {"type": "integer", "minimum": 1},
        "tokens": {"type": "array", "items": {"type": "integer"}},
        "token_strs": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
    },
}
_DETOKENIZE_ANSWER = {
    "type": "object",
    "required": ["prompt"],
    "properties": {"prompt": {"type": "string"}},
}


def _tokenizer_op(summary: str, request: dict, answer: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {
                    "description": "the node's answer",
                    "content": {"application/json": {"schema": _ref(answer)}},
                },
                **{
                    code: _error(why) for code, why in _ERRORS.items() if code not in ("429", "504")
                },
            },
        }
    }


_TOKENIZER_MODELS = ("TokenizePrompt", "TokenizeChat", "Detokenize")


def _components() -> dict[str, Any]:
    _, defs = models_json_schema(
        [
            (ChatRequest, "validation"),
            (CompletionRequest, "validation"),
            (TokenizePrompt, "validation"),
            (TokenizeChat, "validation"),
            (Detokenize, "validation"),
        ],
        ref_template=_REF,
    )
    return {
        **defs["$defs"],
        "TokenizeAnswer": _TOKENIZE_ANSWER,
        "DetokenizeAnswer": _DETOKENIZE_ANSWER,
        "GenerateRequest": _GENERATE_REQUEST,
        "SamplingParams": _NATIVE_SAMPLING,
        "Error": _ERROR,
        "ChatCompletion": _CHAT_COMPLETION,
        "TextCompletion": _TEXT_COMPLETION,
        "GenerateAnswer": _NATIVE_ANSWER,
        "ModelList": _MODEL_LIST,
        "Health": _HEALTH,
    }


_STATIC_COMPONENTS = _components()


def openapi_document(
    models: list[str], max_context: int | None, auth: bool, tools: bool = True
) -> dict[str, Any]:
    """The document for the router as it is now: `models` served, smallest node context
    `max_context` (None: unknown), `auth`: whether /v1/* and /generate need the API key, `tools`:
    whether a served model takes tools."""
    schemas = copy.deepcopy(_STATIC_COMPONENTS)
    if not tools:
        schemas["ChatRequest"]["properties"].update(copy.deepcopy(_NO_TOOLS))
        schemas["TokenizeChat"]["properties"]["tools"] = copy.deepcopy(_NO_TOOLS["tools"])
    for name in ("ChatRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        if models:
            props["model"] = {"type": "string", "enum": models}
        if max_context:
            for key in ("max_tokens", "max_completion_tokens"):
                if key in props:
                    props[key]["anyOf"][0]["maximum"] = max_context - 1
    if models:
        schemas["GenerateRequest"]["properties"]["model"]["enum"] = models
    for name in _TOKENIZER_MODELS:
        if models:
            schemas[name]["properties"]["model"] = {
                "anyOf": [{"type": "string", "enum": models}, {"type": "null"}]
            }
    if max_context:
        schemas["SamplingParams"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] = (
            max_context - 1
        )

    models_op = {
        "get": {
            "summary": "served model names",
            "responses": {
                "200": {
                    "description": "the models",
                    "content": {"application/json": {"schema": _ref("ModelList")}},
                },
                "401": _error(_ERRORS["401"]),
            },
        }
    }
    paths = {
        "/v1/chat/completions": _generation(
            "OpenAI chat completion", "ChatRequest", "ChatCompletion"
        ),
        "/v1/completions": _generation(
            "OpenAI text completion", "CompletionRequest", "TextCompletion"
        ),
        "/generate": _generation(
            "native request, forwarded to a node pair", "GenerateRequest", "GenerateAnswer"
        ),
        "/v1/models": models_op,
        "/tokenize": _tokenizer_op(
            "the model's tokens of a prompt or chat (vLLM's shape)",
            {"anyOf": [_ref("TokenizePrompt"), _ref("TokenizeChat")]},
            "TokenizeAnswer",
        ),
        "/detokenize": _tokenizer_op(
            "the text of token ids (vLLM's shape)", _ref("Detokenize"), "DetokenizeAnswer"
        ),
    }
    if auth:
        for item in paths.values():
            for op in item.values():
                op["security"] = [{"bearer": []}]
    else:
        for item in paths.values():
            for op in item.values():
                op["responses"].pop("401")
    paths["/health"] = {
        "get": {
            "summary": "whether a request could be routed now",
            "responses": {
                code: {
                    "description": why,
                    "content": {"application/json": {"schema": _ref("Health")}},
                }
                for code, why in (("200", "a request can be routed"), ("503", "no eligible worker"))
            },
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve router", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
