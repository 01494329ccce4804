"""The tool-call parsers (router/tools/parsers.py), their stream (router/tools/stream.py) and the
guides that force calls (router/tools/request.py): on text a real chat template wrote, on every
split of a stream, and on what each family's grammar admits."""

from __future__ import annotations

import json

import pytest
from tiny_model import CHAT_TEMPLATE, QWEN25_TEMPLATE, build_tokenizer

from pdserve.router.tools.models import Tool
from pdserve.router.tools.parsers import parse, scan
from pdserve.router.tools.request import structural_tag
from pdserve.router.tools.stream import ToolStream
from pdserve.runtime.front.chat_template import check_messages, tool_call_format

CALLS = [("get_weather", {"city": "Paris", "n": [1, {"a": '}] \\"'}]}), ("noop", {})]
TOOL = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
)
# What each family's model writes, as its template teaches it (vLLM's parsers read the same).
WRITTEN = {
    "hermes": 'Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Rome"}}; '
    '{"name": "noop", "parameters": {}}',
    "mistral": 'Let me see.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
    '{"name": "noop", "arguments": {}}]',
}


@pytest.fixture(scope="module")
def qwen_tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("qwen-tok"), chat_template=QWEN25_TEMPLATE)


def test_template_formats(qwen_tok, tmp_path):
    assert tool_call_format(qwen_tok) == "hermes"
    assert tool_call_format(build_tokenizer(tmp_path, chat_template=CHAT_TEMPLATE)) is None


def test_hermes_reads_what_the_qwen_template_writes(qwen_tok):
    """An assistant turn with calls, rendered by Qwen2.5's template, parses back to those calls."""
    msgs = check_messages(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": "Sure.",
                    "tool_calls": [
                        {
                            "id": f"c{i}",
                            "type": "function",
                            "function": {"name": n, "arguments": json.dumps(a)},
                        }
                        for i, (n, a) in enumerate(CALLS)
                    ],
                },
            ]
        }
    )
    text = qwen_tok.apply_chat_template(msgs, tokenize=False)
    answer = text.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    content, calls = parse("hermes", answer)
    assert content == "Sure.\n"  # the text before the marker, as it is (as vLLM)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS


@pytest.mark.parametrize("fmt", list(WRITTEN))
def test_each_family(fmt):
    content, calls = parse(fmt, WRITTEN[fmt])
    assert content == {"llama3_json": None, "hermes": "Let me see.\n"}.get(fmt, "Let me see.")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}),
        ("noop", {}),
    ]


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("hermes", "no calls here, only <tool"),
        ("hermes", 'a <tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>'),  # bad JSON
        ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
        ("llama3_json", 'The answer is {"name": "f"}'),  # not at the start: text
        ("llama3_json", '{"name": "f", "parameters": [1]}'),  # arguments not an object
        ("mistral", "[TOOL_CALLS] nope"),
    ],
)
def test_what_does_not_parse_is_content(fmt, text):
    assert parse(fmt, text) == (text, [])


@pytest.mark.parametrize("fmt", list(WRITTEN))
@pytest.mark.parametrize("step", [1, 3, 7])
def test_a_stream_adds_up_to_the_whole_answer(fmt, step):
    text = WRITTEN[fmt]
    stream, deltas = ToolStream(fmt), []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i : i + step])
    deltas += stream.feed("", final=True)
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for tc in d.get("tool_calls", ()):
            if "id" in tc:
                assert tc["index"] not in calls, "the header comes once, first"
                calls[tc["index"]] = [tc["function"]["name"], tc["function"]["arguments"]]
            else:
                calls[tc["index"]][1] += tc["function"]["arguments"]
    whole_content, whole = parse(fmt, text)
    assert content == (whole_content or "")
    assert [tuple(calls[i]) for i in sorted(calls)] == [(c.name, c.arguments) for c in whole]
    if step == 1:  # the arguments go out as they are generated, not at the end
        assert sum("tool_calls" in d and "id" not in d["tool_calls"][0] for d in deltas) > 2


def test_a_stream_that_ends_in_a_broken_call_sends_the_rest_as_content():
    text = 'hi <tool_call>\n{"name": "f", "arguments": {"x": 1'
    stream = ToolStream("hermes")
    sent = stream.feed(text) + stream.feed("", final=True)
    assert "".join(d.get("content", "") for d in sent) == text


def test_scan_holds_back_the_start_of_a_marker():
    assert scan("hermes", "Sure.<tool_ca").content == "Sure."
    assert scan("hermes", "Sure.<tool_ca", final=True).content == "Sure.<tool_ca"


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_the_forced_grammar_admits_the_familys_calls_and_nothing_else(qwen_tok, fmt):
    """The guide of `tool_choice: required` accepts a call as the parser reads it, and refuses
    text before it."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(qwen_tok)
    compiler = xgr.GrammarCompiler(info)
    grammar = compiler.compile_grammar(
        xgr.Grammar.from_structural_tag(json.dumps(structural_tag(fmt, [TOOL], parallel=True)))
    )
    one = parse(fmt, WRITTEN[fmt])[1][0]
    assert one.name == "get_weather"
    text = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        "</tool_call>",
        "llama3_json": '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    }[fmt]
    matcher = xgr.GrammarMatcher(grammar)
    assert all(
        matcher.accept_token(t) for t in qwen_tok(text, add_special_tokens=False)["input_ids"]
    )
    assert matcher.accept_token(qwen_tok.eos_token_id) and matcher.is_terminated()
    assert parse(fmt, text)[1][0].arguments == '{"city": "Rome"}'
    refused = xgr.GrammarMatcher(grammar)
    assert not refused.accept_string("Sure.")
