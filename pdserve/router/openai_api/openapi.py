"""The router's OpenAPI 3.1 document for its public API, served at `GET /openapi.json`.

The OpenAI request bodies are the pydantic models of router/openai_api/protocol.py (their
validators' rules are stated there with `json_schema_extra`). The native `/generate` body follows
the node's rules (engine/core.py `SamplingParams`, docs/PROTOCOL.md); it and the responses are
written out in router/openai_api/openapi_schemas.py. This module assembles paths and components.
Three facts are only known at run time and go in per call: the served model names (`model` enum),
the smallest node context (largest `max_tokens`), and whether any served model takes tools (if
none does, `tools` is only `[]` and `tool_choice` only `none` or `auto`).
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic.json_schema import models_json_schema

from pdserve.router.openai_api.openapi_schemas import FIXED_SCHEMAS, NO_TOOLS, REF_TEMPLATE, ref
from pdserve.router.openai_api.protocol import ChatRequest, CompletionRequest
from pdserve.router.openai_api.tokenize import Detokenize, TokenizeChat, TokenizePrompt

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
    return {"description": description, "content": {"application/json": {"schema": ref("Error")}}}


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
                "content": {"application/json": {"schema": ref(request)}},
            },
            "responses": {
                "200": {
                    "description": "the answer, or an SSE stream when `stream` is true",
                    "content": {
                        "application/json": {"schema": ref(answer)},
                        "text/event-stream": sse,
                    },
                },
                **{code: _error(why) for code, why in _ERRORS.items()},
            },
        }
    }


def _tokenizer_op(summary: str, request: dict, answer: str) -> dict:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {
                    "description": "the node's answer",
                    "content": {"application/json": {"schema": ref(answer)}},
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
        ref_template=REF_TEMPLATE,
    )
    return {**defs["$defs"], **FIXED_SCHEMAS}


_STATIC_COMPONENTS = _components()


def _schemas(models: list[str], max_context: int | None, tools: bool) -> dict[str, Any]:
    """The component schemas with the run-time facts filled in."""
    schemas = copy.deepcopy(_STATIC_COMPONENTS)
    if not tools:
        schemas["ChatRequest"]["properties"].update(copy.deepcopy(NO_TOOLS))
        schemas["TokenizeChat"]["properties"]["tools"] = copy.deepcopy(NO_TOOLS["tools"])
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
    return schemas


def _paths(auth: bool) -> dict[str, Any]:
    """Every path; with `auth`, all but /health need the bearer key, else none answers 401."""
    models_op = {
        "get": {
            "summary": "served model names",
            "responses": {
                "200": {
                    "description": "the models",
                    "content": {"application/json": {"schema": ref("ModelList")}},
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
            {"anyOf": [ref("TokenizePrompt"), ref("TokenizeChat")]},
            "TokenizeAnswer",
        ),
        "/detokenize": _tokenizer_op(
            "the text of token ids (vLLM's shape)", ref("Detokenize"), "DetokenizeAnswer"
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
                    "content": {"application/json": {"schema": ref("Health")}},
                }
                for code, why in (("200", "a request can be routed"), ("503", "no eligible worker"))
            },
        }
    }
    return paths


def openapi_document(
    models: list[str], max_context: int | None, auth: bool, tools: bool = True
) -> dict[str, Any]:
    """The document for the router as it is now: `models` served, smallest node context
    `max_context` (None: unknown), `auth`: whether /v1/* and /generate need the API key, `tools`:
    whether a served model takes tools."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve router", "version": "1"},
        "paths": _paths(auth),
        "components": {
            "schemas": _schemas(models, max_context, tools),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
