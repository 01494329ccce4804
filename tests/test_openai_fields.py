"""Every OpenAI request field is implemented or refused (issue #19): through the official `openai`
SDK against a router and stub nodes. Fields pdserve does not implement are accepted only at a
neutral value and never reach a node; any other value, and any unknown field, is a 400 with code
`unsupported_parameter` and `param` naming the field."""

from __future__ import annotations

import json

import openai
import pytest
from stub_node import Cluster

from pdserve.router.openai_api import unimplemented_fields
from pdserve.router.openai_api.openapi import openapi_document
from pdserve.router.routing.attempt import node_share

MODEL = "stub-model"
CHAT = [{"role": "user", "content": "one two three"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def cluster():
    with Cluster(prefill=0, decode=0, colocated=1) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="none", timeout=10, max_retries=0)


def refused(call, param: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    err = info.value.body
    assert err["code"] == "unsupported_parameter", err
    assert err["param"] == param and param in err["message"], err
    return info.value


# Real uses of the fields clients send most, through the SDK's own arguments.
# (`n`, `best_of`: tests/test_openai_choices.py; `tools`, `tool_choice`: tests/test_tool_calls.py)
CHAT_USES = {
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "flex",
    "reasoning_effort": "low",
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "functions": [TOOL["function"]],
    "function_call": {"name": "get_weather"},
}
VLLM_USES = {  # vLLM's extensions travel in extra_body
    "use_beam_search": True,
    "min_tokens": 4,
    "chat_template_kwargs": {"enable_thinking": False},
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "add_generation_prompt": False,
}


@pytest.mark.parametrize("field", list(CHAT_USES))
def test_openai_fields_in_real_use_are_refused_and_named(client, cluster, field):
    before = cluster.colocated[0].stats.generate
    refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, **{field: CHAT_USES[field]}
        ),
        field,
    )
    assert cluster.colocated[0].stats.generate == before, "nothing reached the node"


@pytest.mark.parametrize("field", list(VLLM_USES))
def test_vllm_extensions_in_real_use_are_refused_and_named(client, field):
    refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2, extra_body={field: VLLM_USES[field]}
        ),
        field,
    )


def test_every_listed_field_refuses_a_value_other_than_its_neutral_ones(client):
    for field in unimplemented_fields.CHAT:
        refused(
            lambda field=field: client.chat.completions.create(
                model=MODEL, messages=CHAT, max_tokens=2, extra_body={field: "on"}
            ),
            field,
        )
    for field in unimplemented_fields.COMPLETION:
        refused(
            lambda field=field: client.completions.create(
                model=MODEL, prompt="a b", max_tokens=2, extra_body={field: "on"}
            ),
            field,
        )


def test_unknown_fields_are_refused_and_named(client):
    refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=CHAT, extra_body={"frobnicate": {"deep": [1]}}
        ),
        "frobnicate",
    )
    refused(
        lambda: client.completions.create(model=MODEL, prompt="a", extra_body={"tools": []}),
        "tools",
    )  # a chat field, unknown to completions
    refused(
        lambda: client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": True},
        ),
        "stream_options.include_obfuscation",
    )
    refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi", "name": "bob"}]
        ),
        "messages.0.name",
    )
    refused(
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi", "colour": "red"}]
        ),
        "messages.0.colour",
    )


def test_tools_on_a_model_without_tool_support_are_refused_and_named(client):
    """tools, tool_choice and parallel_tool_calls are implemented (test_tool_calls.py); the stub
    node reports no tool-call format, as a model whose chat template takes no tools."""
    for kwargs, param, words in (
        ({"tools": [TOOL]}, "tools", "the model's chat template has no tool support"),
        ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **kwargs)
        err = info.value.body
        assert err["param"] == param and words in err["message"], err
        assert err["code"] == "invalid_value", err


def test_neutral_values_are_accepted_and_never_reach_the_node(client, cluster):
    neutral = {
        field: values[0] if values else None for field, values in unimplemented_fields.CHAT.items()
    }
    out = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, user="u-1", extra_body=neutral
    )
    assert out.choices[0].message.content == "one two"
    body = cluster.colocated[0].stats.bodies[-1]
    assert set(body) == {"messages", "sampling_params", "rid", "stream", *node_share(None)}, body
    # And the ones clients send as SDK arguments, at their defaults.
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=2,
        n=1,
        presence_penalty=0,
        frequency_penalty=0.0,
        logit_bias={},
        tools=[],
        parallel_tool_calls=False,
        response_format={"type": "text"},
        store=False,
        stream_options=None,
    )
    assert out.choices[0].message.content == "one two"
    text = (
        client.completions.create(
            model=MODEL, prompt="a b", max_tokens=2, echo=False, suffix="", best_of=1, n=1
        )
        .choices[0]
        .text
    )
    assert text == "a b"


def test_top_logprobs_without_logprobs_is_refused(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, top_logprobs=2)
    assert info.value.body["param"] == "top_logprobs"


def test_openapi_document_lists_the_refused_fields_with_their_neutral_values():
    schemas = openapi_document([MODEL], 256, auth=False)["components"]["schemas"]
    for name, table in (
        ("ChatRequest", unimplemented_fields.CHAT),
        ("CompletionRequest", unimplemented_fields.COMPLETION),
        ("ChatMessage", unimplemented_fields.MESSAGE),
        ("StreamOptions", unimplemented_fields.STREAM_OPTIONS),
    ):
        schema = schemas[name]
        assert schema["additionalProperties"] is False, name
        for field, neutral in table.items():
            prop = schema["properties"][field]
            assert prop["enum"] == [None, *neutral] and "400" in prop["description"], field
    assert {"type": "string"} in schemas["ChatRequest"]["properties"]["user"]["anyOf"]


SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}
# Implemented fields (issue #19 items 4-5): what the node is asked for, in its native form.
IMPLEMENTED = [
    (dict(presence_penalty=0.5), {}, {"presence_penalty": 0.5}),
    (dict(frequency_penalty=-0.3), {}, {"frequency_penalty": -0.3}),
    (dict(logit_bias={"5": 10}), {}, {"logit_bias": {"5": 10.0}}),
    ({}, {"repetition_penalty": 1.2}, {"repetition_penalty": 1.2}),
    (dict(response_format={"type": "json_object"}), {}, {"guide": ["json_object", ""]}),
    (
        dict(
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
        ),
        {},
        {"guide": ["json_schema", json.dumps(SCHEMA)]},
    ),
    ({}, {"guided_json": SCHEMA}, {"guide": ["json_schema", json.dumps(SCHEMA)]}),
    ({}, {"guided_regex": "[a-z]+"}, {"guide": ["regex", "[a-z]+"]}),
    ({}, {"guided_choice": ["yes", "no"]}, {"guide": ["choice", json.dumps(["yes", "no"])]}),
]


@pytest.mark.parametrize("kwargs,extra,native", IMPLEMENTED, ids=range(len(IMPLEMENTED)))
def test_implemented_fields_reach_the_node(client, cluster, kwargs, extra, native):
    node = cluster.colocated[0]
    client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=2, extra_body=extra or None, **kwargs
    )
    sent = node.stats.bodies[-1]["sampling_params"]
    assert {k: sent.get(k) for k in native} == native


def test_two_guides_at_once_are_a_400(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            response_format={"type": "json_object"},
            extra_body={"guided_regex": "a"},
        )
