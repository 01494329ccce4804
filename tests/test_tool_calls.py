"""Tools on real nodes, through the official `openai` SDK (issue #19).

"qwen": a tiny random model with Qwen2.5's chat template (Hermes tool calls), served by a prefill
node and a decode node; "plain": one whose template takes no tools (as SmolLM2's), colocated.
A random model calls no tool by itself: `tool_choice: required` or a named function force the call
with a grammar (router/tools/request.py), and the router's parser reads it back, whole and streamed.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pd_cluster import NODE_ARGS, pd_and_colocated
from tiny_model import QWEN25_TEMPLATE, build_tiny_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "the cache page token"}]
KW = dict(max_tokens=160, temperature=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tool-calls")
    qwen = build_tiny_model(tmp / "qwen", num_layers=2, seed=3, chat_template=QWEN25_TEMPLATE)
    plain = build_tiny_model(tmp / "plain", num_layers=2, seed=3)
    q_args = ["--model", str(qwen), "--pp", "1", *NODE_ARGS, "--max-context", "1024"]
    p_args = ["--model", str(plain), "--pp", "1", *NODE_ARGS, "--max-context", "256"]
    with pd_and_colocated(tmp, q_args, p_args) as (url, nodes):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield {"client": client, "nodes": nodes}


def check_call(call, name: str) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    if name == "get_weather":
        assert args["city"] in ("Paris", "Rome") and isinstance(args["days"], int), args
    else:
        assert set(args) == {"utc"} and isinstance(args["utc"], bool), args
    return args


def test_nodes_report_their_templates_tool_call_format(served):
    for node, want in (("prefill", "hermes"), ("decode", "hermes"), ("colocated", None)):
        info = httpx.get(served["nodes"][node] + "/server_info", timeout=10).json()
        assert info["tool_call_format"] == want, node


def test_required_forces_a_call_that_the_parser_reads(served):
    out = served["client"].chat.completions.create(
        model="qwen",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        **KW,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    check_call(call, call.function.name)


def test_named_function_streams_tool_call_deltas(served):
    """The stream sends the call's id, type and name first, then its arguments; they add up to the
    same call as the whole answer (greedy: the same text)."""
    kw = dict(
        model="qwen",
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        **KW,
    )
    whole = served["client"].chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    want = check_call(whole.message.tool_calls[0], "get_time")
    chunks = list(served["client"].chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert calls[0].index == 0 and calls[0].id.startswith("call_")
    assert calls[0].type == "function" and calls[0].function.name == "get_time"
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:])
    # How many fragments depends on how many tokens the node's front coalesced into one event (on
    # a loaded machine: all of them, once); that each token's text goes out as it comes is
    # test_tool_parsers.py test_a_stream_adds_up_to_the_whole_answer[step=1].
    fragments = [tc.function.arguments for tc in calls[1:]]
    assert fragments
    assert json.loads("".join(fragments)) == want
    assert "".join(fragments) == whole.message.tool_calls[0].function.arguments
    assert not any(d.content for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_answers_text_when_the_model_calls_nothing(served):
    out = served["client"].chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER], max_tokens=8, temperature=0
    )
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_a_tool_conversation_renders(served):
    """An assistant message with tool_calls (no content) and the tool's answer, then a forced
    call again."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = served["client"].chat.completions.create(
        model="qwen",
        messages=history,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # a random model, free to go on, makes calls to the end
        **KW,
    )
    check_call(out.choices[0].message.tool_calls[0], "get_weather")


BAD_SCHEMA_TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
    },
}


def test_tool_errors_name_the_field(served):
    client = served["client"]
    cases = [
        (dict(model="plain", tools=[WEATHER]), "tools", "no tool support"),
        (dict(model="qwen", tool_choice="required"), "tool_choice", "needs tools"),
        (
            dict(
                model="qwen",
                tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "nope"}},
            ),
            "tool_choice",
            "not one of the tools",
        ),
        (
            dict(
                model="qwen",
                tools=[WEATHER],
                tool_choice="required",
                response_format={"type": "json_object"},
            ),
            "tool_choice",
            "cannot be combined",
        ),
        (
            dict(model="qwen", tools=[{"type": "function", "function": {"name": "a b"}}]),
            "tools.0.function.name",
            "",
        ),
        (dict(model="qwen", extra_body={"functions": [WEATHER["function"]]}), "functions", ""),
        (  # the node cannot compile the forced call's guide from this schema: the client's field
            dict(model="qwen", tools=[BAD_SCHEMA_TOOL], tool_choice="required"),
            "tools",
            "tools",
        ),
    ]
    for kw, param, words in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(messages=ASK, max_tokens=4, **kw)
        body = err.value.body
        assert body["param"] == param, (kw, body)
        assert words in body["message"], body


def test_tokenize_renders_the_tools(served):
    """/tokenize takes the same tools: the prompt holds them (Qwen's template lists each tool's
    JSON); a model without tool support refuses them, naming `tools`."""
    url = str(served["client"].base_url).removesuffix("/v1/")
    bare = httpx.post(f"{url}/tokenize", json={"model": "qwen", "messages": ASK}, timeout=30)
    with_tools = httpx.post(
        f"{url}/tokenize", json={"model": "qwen", "messages": ASK, "tools": [WEATHER]}, timeout=30
    )
    assert bare.status_code == with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["count"] > bare.json()["count"] + 20
    refused = httpx.post(
        f"{url}/tokenize", json={"model": "plain", "messages": ASK, "tools": [WEATHER]}, timeout=30
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools", refused.text
