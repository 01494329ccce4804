"""OpenAI semantics on real nodes (issue #19), through the official `openai` SDK.

Two tiny models behind one router: A has sampling defaults in its generation_config.json and a
64-token context, and is served by a prefill node and a decode node; B has none and an 80-token
context, and is served by a colocated node.

Sampled outputs are compared under a fixed `seed` (a seeded request draws from a generator seeded
by the seed and its step, engine/sampling.py), so no assertion depends on chance or timing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from pd_cluster import NODE_ARGS, pd_and_colocated
from prometheus_client.parser import text_string_to_metric_families
from tiny_model import build_tiny_model
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

CONTEXT = {"tiny-a": 64, "tiny-b": 80}
A_DEFAULTS = {"temperature": 0.3, "top_p": 0.95}
QUESTION = [{"role": "user", "content": "the cache page token"}]


def tiny(base: Path, name: str, defaults: dict) -> Path:
    path = build_tiny_model(base / name, num_layers=2, seed=3)
    gen = path / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), **defaults}))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-serving")
    model_a = tiny(tmp, "tiny-a", A_DEFAULTS)
    model_b = tiny(tmp, "tiny-b", {})
    a_args = ["--model", str(model_a), "--pp", "1", *NODE_ARGS]
    b_args = ["--model", str(model_b), "--pp", "1", *NODE_ARGS]
    a_args += ["--max-context", str(CONTEXT["tiny-a"])]
    b_args += ["--max-context", str(CONTEXT["tiny-b"])]
    with pd_and_colocated(tmp, a_args, b_args) as (url, nodes):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield {
            "a": client,
            "b": client,
            "url": url,  # one router; "a"/"b" name the model
            "nodes": nodes,
            "paths": {"tiny-a": model_a, "tiny-b": model_b},
        }


def chat(client: openai.OpenAI, model: str, ignore_eos: bool = False, **kw) -> str:
    out = client.chat.completions.create(
        model=model, messages=QUESTION, extra_body={"ignore_eos": ignore_eos}, **kw
    )
    return out.choices[0].message.content


def test_nodes_report_the_models_sampling_defaults(served):
    for name, want in (("prefill", A_DEFAULTS), ("decode", A_DEFAULTS), ("colocated", {})):
        info = httpx.get(served["nodes"][name] + "/server_info", timeout=10).json()
        assert info["sampling_defaults"] == want, name


def test_absent_temperature_and_top_p_are_the_models_generation_config(served):
    """Model A, over PD (the prefill node samples the first token, with the same defaults)."""
    a = served["a"]
    implicit = chat(a, "tiny-a", max_tokens=24, seed=11, ignore_eos=True)
    explicit = chat(a, "tiny-a", max_tokens=24, seed=11, ignore_eos=True, **A_DEFAULTS)
    assert implicit == explicit
    assert implicit != chat(a, "tiny-a", max_tokens=24, seed=11, ignore_eos=True, temperature=0)
    assert implicit != chat(
        a, "tiny-a", max_tokens=24, seed=11, ignore_eos=True, temperature=1.0, top_p=1.0
    )


def test_absent_temperature_without_generation_config_is_one(served):
    """Model B has no sampling defaults: temperature 1, no filter, as OpenAI and vLLM."""
    b = served["b"]
    implicit = chat(b, "tiny-b", max_tokens=24, seed=11, ignore_eos=True)
    assert implicit == chat(b, "tiny-b", max_tokens=24, seed=11, ignore_eos=True, temperature=1.0)
    assert implicit != chat(b, "tiny-b", max_tokens=24, seed=11, ignore_eos=True, temperature=0)


@pytest.mark.parametrize("router, model", [("a", "tiny-a"), ("b", "tiny-b")])
def test_chat_without_max_tokens_runs_to_the_end_of_the_context(served, router, model):
    for stream in (False, True):
        kw = dict(model=model, messages=QUESTION, temperature=0, extra_body={"ignore_eos": True})
        if stream:
            chunks = list(
                served[router].chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw
                )
            )
            usage = chunks[-1].usage
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            out = served[router].chat.completions.create(**kw)
            usage, finish = out.usage, out.choices[0].finish_reason
        assert finish == "length"
        assert usage.prompt_tokens + usage.completion_tokens == CONTEXT[model], (stream, usage)


def test_completions_keep_openais_default_of_16_tokens(served):
    for router, model in (("a", "tiny-a"), ("b", "tiny-b")):
        out = served[router].completions.create(
            model=model, prompt="the cache", temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
        out = served[router].completions.create(
            model=model,
            prompt="the cache",
            temperature=0,
            max_tokens=None,
            extra_body={"ignore_eos": True},
        )
        assert out.usage.prompt_tokens + out.usage.completion_tokens == CONTEXT[model], "null: rest"


# --- usage.prompt_tokens_details.cached_tokens and stop_reason ----------------------------------

LONG = "prefill decode pipeline cache page token layer request router transfer rank slot"


@pytest.mark.parametrize("router, model", [("a", "tiny-a"), ("b", "tiny-b")])
def test_cached_tokens_count_the_prefix_cache_hit_of_a_repeated_prompt(served, router, model):
    """On A the prefill node's hit (the decode node holds no prefix cache), on B the colocated
    node's; streamed and not."""
    client = served[router]
    messages = [{"role": "user", "content": f"{router} {LONG}"}]
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, temperature=0
    )
    assert first.usage.prompt_tokens > 24
    # a prompt never seen: at most the chat template's opening page was cached before
    assert first.usage.prompt_tokens_details.cached_tokens <= 4
    again = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, temperature=0
    )
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens, again.usage
    assert again.usage.prompt_tokens - cached <= 4, "all but the last page, at most (page size 4)"
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=2,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    for _ in range(2):  # no chat template: other tokens, cached from the second time on
        text = client.completions.create(
            model=model, prompt=f"{router} {LONG}", max_tokens=2, temperature=0
        )
    assert text.usage.prompt_tokens - text.usage.prompt_tokens_details.cached_tokens <= 4


@pytest.mark.parametrize("router, model", [("a", "tiny-a"), ("b", "tiny-b")])
def test_stop_reason_is_the_matched_stop_string_or_token_id(served, router, model):
    client = served[router]
    kw = dict(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=20,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "length" and full.choices[0].stop_reason is None
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and text.index(stop) > 0
    out = client.chat.completions.create(stop=[stop, "zzzz"], **kw)
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == stop
    assert out.choices[0].message.content == text[: text.index(stop)]
    chunks = list(client.chat.completions.create(stop=stop, stream=True, **kw))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1].choices[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    # a stop token id: the id of the 5th generated token
    ids = client.completions.create(
        model=model,
        prompt=[5, 6, 7, 8],
        temperature=0,
        max_tokens=8,
        logprobs=0,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    fifth = int(ids.choices[0].logprobs.tokens[4].removeprefix("token_id:"))
    out = client.completions.create(
        model=model,
        prompt=[5, 6, 7, 8],
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True, "stop_token_ids": [fifth]},
    )
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == fifth


# --- /tokenize and /detokenize ----------------------------------------------------------------


@pytest.mark.parametrize("router, model", [("a", "tiny-a"), ("b", "tiny-b")])
def test_tokenize_counts_what_the_server_counts_and_detokenize_inverts_it(served, router, model):
    tok = AutoTokenizer.from_pretrained(served["paths"][model])
    url, client = served["url"], served[router]
    text = "prefill decode ünïcode 💡 cache"
    r = httpx.post(
        f"{url}/tokenize",
        json={"model": model, "prompt": text, "return_token_strs": True},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["tokens"] == tok(text)["input_ids"] and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == CONTEXT[model], "a node of the model answered"
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    usage = client.completions.create(model=model, prompt=text, max_tokens=1, temperature=0).usage
    assert usage.prompt_tokens == got["count"]
    back = httpx.post(
        f"{url}/detokenize", json={"model": model, "tokens": got["tokens"]}, timeout=30
    ).json()
    assert back == {"prompt": text}
    # chat: the template with the generation prompt, as a chat completion counts it
    r = httpx.post(f"{url}/tokenize", json={"model": model, "messages": QUESTION}, timeout=30)
    assert r.status_code == 200 and r.json()["token_strs"] is None
    usage = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=1, temperature=0
    ).usage
    assert r.json()["count"] == usage.prompt_tokens
    bare = httpx.post(
        f"{url}/tokenize",
        json={"model": model, "messages": QUESTION, "add_generation_prompt": False},
        timeout=30,
    ).json()
    assert (
        bare["tokens"] == r.json()["tokens"][: bare["count"]]
        and bare["count"] < usage.prompt_tokens
    )


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"prompt": "a", "messages": QUESTION}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
        ("/tokenize", {"messages": QUESTION, "chat_template": "{{ x }}"}, 400, "chat_template"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
        ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),  # beyond the vocabulary: node
        ("/detokenize", {"tokens": [1] * ((1 << 18) + 1)}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_input_naming_the_field(served, path, body, status, param):
    r = httpx.post(f"{served['url']}{path}", json={"model": "tiny-b", **body}, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.json()


# --- routing by model -------------------------------------------------------------------------


def finished(node: str) -> float:
    """Requests the node finished (any finish reason; a prefill node's are `prefill_done`)."""
    text = httpx.get(f"{node}/metrics", timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "pdserve_requests"
        for s in f.samples
        if s.name == "pdserve_requests_total"
    )


def test_models_are_listed_once_each_with_their_context(served):
    models = served["a"].models.list().data
    assert [(m.id, m.max_model_len) for m in models] == sorted(CONTEXT.items())


def test_each_model_gets_only_its_own_traffic_and_an_unknown_one_404(served):
    nodes, client = served["nodes"], served["a"]
    before = {name: finished(url) for name, url in nodes.items()}
    for i in range(3):
        for model in ("tiny-a", "tiny-b"):
            out = client.chat.completions.create(
                model=model,
                max_tokens=2,
                temperature=0,
                messages=[{"role": "user", "content": f"q{i}"}],
            )
            assert out.model == model
        stream = client.completions.create(
            model="tiny-b", prompt=f"p{i}", max_tokens=2, stream=True
        )
        assert {c.model for c in stream} == {"tiny-b"}
    url = served["url"]
    r = httpx.post(
        f"{url}/generate",
        json={"model": "tiny-a", "text": "x", "sampling_params": {"max_tokens": 2}},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    # the router answers a native request once the decode node has: the prefill node may count
    # its part a moment later, so its count is awaited (bounded), then compared exactly
    want = {"prefill": 4, "decode": 4, "colocated": 6}
    deadline = time.monotonic() + 30
    while True:
        counts = {name: finished(u) - before[name] for name, u in nodes.items()}
        if counts == want or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert counts == want
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="tiny-c", messages=QUESTION, max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    for path, body in (
        ("/generate", {"model": "tiny-c", "text": "x"}),
        ("/tokenize", {"model": "tiny-c", "prompt": "x"}),
    ):
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    # two models: one must be named where a request may leave it out
    for path, body in (
        ("/generate", {"text": "x"}),
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [1]}),
    ):
        r = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert {name: finished(u) - before[name] for name, u in nodes.items()} == want, "no traffic"


# --- logprobs with the tokens' text -----------------------------------------------------------


def vocab_bytes(path: Path) -> set[bytes]:
    """Every token's own bytes, from the tokenizer's vocabulary and GPT-2's byte table."""
    tok = AutoTokenizer.from_pretrained(path)
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tok.all_special_tokens)
    return {
        piece.encode() if piece in special else bytes(byte_of[c] for c in piece)
        for piece in tok.get_vocab()
    }


def _no_specials(content, special: set[str]):
    return [c for c in content if c.token not in special]


def _check_chat_logprobs(client, kw: dict, special: set[str], known: set[bytes]):
    """A greedy chat answer's logprobs: real tokens whose texts and bytes make the answer."""
    out = client.chat.completions.create(messages=QUESTION, **kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 12
    kept = _no_specials(content, special)
    assert "".join(c.token for c in kept) == out.choices[0].message.content
    # the random model emits stray UTF-8 continuation bytes: the text shows them as U+FFFD
    raw = b"".join(bytes(c.bytes) for c in kept)
    assert raw.decode("utf-8", "replace") == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and all(bytes(t.bytes) in known for t in c.top_logprobs)
        assert bytes(c.bytes) in known
        best = c.top_logprobs[0]  # greedy: the sampled token is the most likely one
        assert (bytes(best.bytes), best.logprob) == (bytes(c.bytes), c.logprob)
    return out, content


def _check_streamed_chat_logprobs(client, kw: dict, out, content) -> None:
    """The same chat request streamed: the same logprob tokens and the same text."""
    streamed = list(client.chat.completions.create(messages=QUESTION, stream=True, **kw))
    parts = [
        lp
        for ch in streamed
        if ch.choices and ch.choices[0].logprobs
        for lp in ch.choices[0].logprobs.content
    ]
    assert [(p.token, p.bytes) for p in parts] == [(c.token, c.bytes) for c in content]
    assert (
        "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
        == out.choices[0].message.content
    )


def _check_completion_logprobs(client, kw: dict, special: set[str]) -> None:
    """Completions: tokens, offsets into the text, top alternatives keyed by their text; the
    streamed request gives the same tokens and offsets."""
    text = client.completions.create(
        prompt="the cache",
        logprobs=2,
        **{k: v for k, v in kw.items() if k not in ("logprobs", "top_logprobs")},
    )
    lp = text.choices[0].logprobs
    tokens = [t for t in lp.tokens if t not in special]
    assert "".join(tokens) == text.choices[0].text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs)
    chunks = list(
        client.completions.create(
            prompt="the cache",
            logprobs=2,
            stream=True,
            **{k: v for k, v in kw.items() if k not in ("logprobs", "top_logprobs")},
        )
    )
    got = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    offsets = [
        o
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset
    ]
    assert got == lp.tokens and offsets == lp.text_offset


@pytest.mark.parametrize("router, model", [("a", "tiny-a"), ("b", "tiny-b")])
def test_logprob_tokens_are_real_tokens_whose_texts_make_the_answer(served, router, model):
    client = served[router]
    special = set(AutoTokenizer.from_pretrained(served["paths"][model]).all_special_tokens)
    known = vocab_bytes(served["paths"][model])
    kw = dict(
        model=model,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    out, content = _check_chat_logprobs(client, kw, special, known)
    _check_streamed_chat_logprobs(client, kw, out, content)
    # completions: tokens, offsets into the text, top alternatives keyed by their text
    _check_completion_logprobs(client, kw, special)
