"""The hand-written parts of the router's OpenAPI document (router/openai_api/openapi.py): the
native `/generate` body, which follows the node's rules (engine/core.py `SamplingParams`,
docs/PROTOCOL.md), and every answer and error body. The OpenAI request bodies are not here: they
are the pydantic models of router/openai_api/protocol.py.
"""

from __future__ import annotations

from pdserve.router.openai_api.field_types import MAX_N
from pdserve.router.openai_api.protocol import TOKEN_IDS_SCHEMA

REF_TEMPLATE = "#/components/schemas/{model}"


def ref(name: str) -> dict[str, str]:
    """A reference to the component schema `name`."""
    return {"$ref": REF_TEMPLATE.format(model=name)}


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
        "sampling_params": ref("SamplingParams"),
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
# ChatRequest's (and TokenizeChat's) tool fields when no served model takes tools.
NO_TOOLS = {
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


# The components written out here, by name, in the document's order.
FIXED_SCHEMAS = {
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
