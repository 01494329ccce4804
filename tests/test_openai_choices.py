"""`n` > 1 choices, seeds per choice, and bad guides naming the client's field (issue #19), on real
nodes through the official `openai` SDK: model A on a prefill node + a decode node, model B on a
colocated node (the `served` cluster of tests/test_openai_serving.py).

The prompt is computed once: choice 0 first, the others after its first token, when the node's
prefix cache holds the prompt's whole pages (router/openai_api/n_choices.py). The node's
`pdserve_prefix_cache_hit_tokens` counter shows it.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import test_openai_serving
from metrics_scrape import scrape, total

served = test_openai_serving.served  # the cluster fixture, one per module that uses it
PAGE = 4  # tests/cluster.py node flags
CACHE_NODE = {"tiny-a": "prefill", "tiny-b": "colocated"}  # where the prompt is computed
EXTRA = {"ignore_eos": True}


def texts(out) -> list[str]:
    return [c.message.content if hasattr(c, "message") else c.text for c in out.choices]


def create(client: openai.OpenAI, kind: str, model: str, prompt: str, **kw):
    if kind == "chat":
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], extra_body=EXTRA, **kw
        )
    return client.completions.create(model=model, prompt=prompt, extra_body=EXTRA, **kw)


def streamed(client: openai.OpenAI, kind: str, model: str, prompt: str, **kw):
    """(text per choice index, the usage chunk's usage, finish reasons by index)."""
    chunks = list(
        create(
            client, kind, model, prompt, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    got: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            piece = ch.delta.content if kind == "chat" else ch.text
            got[ch.index] = got.get(ch.index, "") + (piece or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    return [got[i] for i in sorted(got)], chunks[-1].usage, finish


def hit_tokens(served, model: str) -> float:
    return total(
        scrape(served["nodes"][CACHE_NODE[model]]), "pdserve_prefix_cache_hit_tokens_total"
    )


def settled_hit_tokens(served, model: str) -> float:
    """The counter once the previous test's hits have arrived: the ranks report it every 0.5 s, so
    a read right after a request can miss that request's hits (CI read such a stale count)."""
    last = hit_tokens(served, model)
    for _ in range(20):
        time.sleep(0.6)
        now = hit_tokens(served, model)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the hit counter of {model}'s node kept moving: {last}")


@pytest.mark.parametrize("model", ["tiny-a", "tiny-b"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_greedy_n3_gives_three_copies_of_the_n1_answer_streamed_or_not(served, kind, model):
    client, prompt = served["a"], f"{kind} greedy {model} the page cache"
    one = create(client, kind, model, prompt, max_tokens=6, temperature=0)
    three = create(client, kind, model, prompt, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert texts(three) == texts(one) * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens == 18
    assert three.usage.total_tokens == one.usage.prompt_tokens + 18
    got, usage, finish = streamed(client, kind, model, prompt, max_tokens=6, temperature=0, n=3)
    assert got == texts(one) * 3 and finish == {0: "length", 1: "length", 2: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (one.usage.prompt_tokens, 18)


@pytest.mark.parametrize("model", ["tiny-a", "tiny-b"])
def test_seeded_n3_is_reproducible_its_choices_differ_and_choice_i_uses_seed_plus_i(served, model):
    client, prompt = served["a"], f"seeded {model} the prefill node decodes"
    kw = dict(max_tokens=12, temperature=1.0, seed=40)
    first = texts(create(client, "chat", model, prompt, n=3, **kw))
    assert texts(create(client, "chat", model, prompt, n=3, **kw)) == first
    assert len(set(first)) == 3, first
    alone = [
        texts(create(client, "chat", model, prompt, **{**kw, "seed": 40 + i}))[0] for i in (1, 2)
    ]
    assert alone == first[1:]
    got, _, _ = streamed(client, "chat", model, prompt, n=3, **kw)
    assert got == first


@pytest.mark.parametrize("model", ["tiny-a", "tiny-b"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_prompt_is_computed_once_the_other_choices_hit_all_its_whole_pages(
    served, model, stream
):
    """On A the prefill node computes the prompt (the decode node gets its KV), on B the colocated
    node. Choice 0's own hit (`cached_tokens`: at most the chat template's opening) plus, for each
    of the 2 others, every whole page of the prompt but the last token's. The choices run to the
    end of the context, so choice 0 is still decoding when the others are admitted."""
    client = served["a"]
    prompt = f"{stream} {model} once: prefill decode cache page token"
    before = settled_hit_tokens(served, model)
    if stream:
        _, usage, _ = streamed(client, "chat", model, prompt, max_tokens=None, temperature=0, n=3)
    else:
        usage = create(client, "chat", model, prompt, max_tokens=None, temperature=0, n=3).usage
    p, cached = usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens
    assert p > 24 and cached < p - PAGE
    want = before + cached + 2 * ((p - 1) // PAGE * PAGE)
    for _ in range(100):  # at least `want` (a report can come late on a loaded machine) ...
        if hit_tokens(served, model) >= want:
            break
        time.sleep(0.1)
    got = settled_hit_tokens(served, model)  # ... and then no more than `want`
    assert got == want, (p, cached, got - before)


# --- fields -----------------------------------------------------------------------------------


def refused(call, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    err = info.value.body
    assert err["param"] == param and err["message"].startswith(param), err


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"n": 2, "extra_body": {"best_of": 3}}, "best_of"),
        ({"extra_body": {"best_of": 2}}, "best_of"),
    ],
)
def test_n_above_16_and_best_of_other_than_n_are_400s_naming_them(served, kw, param):
    client = served["a"]
    refused(
        lambda: client.chat.completions.create(
            model="tiny-b", messages=[{"role": "user", "content": "x"}], max_tokens=2, **kw
        ),
        param,
    )


def test_best_of_equal_to_n_is_served(served):
    out = served["a"].completions.create(
        model="tiny-b", prompt="best of", max_tokens=3, temperature=0, n=2, best_of=2
    )
    assert len(out.choices) == 2 and out.choices[0].text == out.choices[1].text


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nope"}}}


@pytest.mark.parametrize(
    "kw, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": BAD_SCHEMA},
                }
            },
            "response_format",
        ),
        ({"extra_body": {"guided_json": BAD_SCHEMA}}, "guided_json"),
        ({"extra_body": {"guided_json": "{not json"}}, "guided_json"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_choice": ["y" * 40_000, "n" * 40_000]}}, "guided_choice"),
    ],
)
@pytest.mark.parametrize("model", ["tiny-a", "tiny-b"])
def test_a_bad_guide_is_a_400_naming_the_clients_field(served, kw, param, model):
    client = served["a"]
    messages = [{"role": "user", "content": "x"}]
    refused(
        lambda: client.chat.completions.create(model=model, messages=messages, max_tokens=2, **kw),
        param,
    )
    if param != "response_format":
        refused(
            lambda: client.completions.create(model=model, prompt="x", max_tokens=2, n=2, **kw),
            param,
        )


def test_openapi_states_n_and_best_of(served):
    doc = httpx.get(served["url"] + "/openapi.json", timeout=10).json()
    for name in ("ChatRequest", "CompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        for field in ("n", "best_of"):
            branch = props[field]["anyOf"][0]
            assert branch == {"type": "integer", "minimum": 1, "maximum": 16}, (
                name,
                field,
                props[field],
            )
    assert json.dumps(doc)  # serialisable
