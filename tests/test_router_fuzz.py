"""Bad client input never gets a 5xx from the router, and the cluster keeps serving (issue #9).

One real cluster (router with an API key, a prefill node and a decode node on the tiny model with a
256-token context) takes, in file order:
1. a greedy answer, checked against transformers: the reference for the end;
2. schemathesis cases generated from the router's own /openapi.json: valid ones are served (or
   refused for a reason a schema cannot state, see `_refusal_the_schema_cannot_state`) with an
   answer that matches the document; invalid ones get a 4xx that matches it too;
3. hand-written bad input: huge and deep bodies, bad bytes, wrong media types, bad numbers and
   wrong types for every field, bad streaming requests, clients that leave mid-body;
4. the end: every health check passes, the same greedy answer comes back, no KV page is held, the
   router counted no 5xx and no process logged a traceback.
Every request has a client timeout, so a hang fails a test instead of stalling it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import schemathesis
from cluster import NODE_ARGS, free_port, start, wait_healthy
from hypothesis import HealthCheck, Phase, given, settings
from metrics_scrape import parse
from pd_cluster import FAST_TIMEOUTS, wait_pages_free
from reference import hf_greedy, load_hf
from schemathesis import GenerationMode
from schemathesis import checks as st_checks

from pdserve.router.openai_api.protocol import ChatRequest, CompletionRequest

KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 256
TIMEOUT = 60.0  # per request: a hang fails the test
MAX_NEW = 8
PROMPT_IDS = [17, 203, 5, 88, 301, 42, 9, 150, 77, 260]
CHAT_PROMPT = [{"role": "user", "content": "prefill decode rank"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/generate"
POSTS = (CHAT, COMPLETIONS, GENERATE)


@dataclass
class Cluster:
    url: str
    model: str
    nodes: tuple[str, str]
    logs: tuple[Path, ...]
    client: httpx.Client  # with the API key; one connection pool for the whole file


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    pport, bport, dport, rport = (free_port() for _ in range(4))
    args = ["--model", str(tiny_model), "--pp", "1", *NODE_ARGS, "--max-context", str(CONTEXT)]
    logs = tuple(tmp / f"{name}.log" for name in ("prefill", "decode", "router"))
    with contextlib.ExitStack() as stack:
        # Both nodes load at once; each `start` still stops its own process group at the end.
        prefill = stack.enter_context(
            start(
                ["prefill", "--port", str(pport), "--bootstrap-port", str(bport), *args],
                pport,
                logs[0],
                env=FAST_TIMEOUTS,
                wait=False,
            )
        )
        decode = stack.enter_context(
            start(
                ["decode", "--port", str(dport), *args],
                dport,
                logs[1],
                env=FAST_TIMEOUTS,
                wait=False,
            )
        )
        for (url, proc), log in zip((prefill, decode), logs[:2], strict=True):
            wait_healthy(url, proc, 240, log)
        url, _ = stack.enter_context(
            start(
                [
                    "router",
                    "--port",
                    str(rport),
                    "--prefill",
                    prefill[0],
                    str(bport),
                    "--decode",
                    decode[0],
                    "--api-key",
                    KEY,
                    "--health-interval",
                    "1",
                ],
                rport,
                logs[2],
            )
        )
        client = stack.enter_context(httpx.Client(base_url=url, headers=AUTH, timeout=TIMEOUT))
        model = client.get("/v1/models").json()["data"][0]["id"]
        yield Cluster(url, model, (prefill[0], decode[0]), logs, client)


def post(c: Cluster, path: str, *, headers: dict | None = None, **kw) -> httpx.Response:
    return c.client.post(path, headers=headers, **kw)


def greedy_answers(c: Cluster) -> tuple[list[int], str]:
    """(token ids of a native greedy request, text of an OpenAI chat greedy request)."""
    native = post(
        c,
        GENERATE,
        json={
            "input_ids": PROMPT_IDS,
            "sampling_params": {"max_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0},
        },
    )
    chat = post(
        c,
        CHAT,
        json={"model": c.model, "messages": CHAT_PROMPT, "max_tokens": MAX_NEW, "temperature": 0},
    )
    assert native.status_code == 200 and chat.status_code == 200, (native.text, chat.text)
    return native.json()["token_ids"], chat.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def greedy_before(cluster):
    return greedy_answers(cluster)


def openai_error(body: dict) -> dict:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def error_of(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.headers
    return openai_error(r.json())


def expect(
    r: httpx.Response,
    status: int,
    param: str | None = None,
    code: str | None = None,
    what: str = "",
) -> dict:
    assert r.status_code == status, f"{what}: {r.status_code} {r.text[:300]}"
    err = error_of(r)
    if param is not None:
        assert err["param"] == param, f"{what}: {err}"
        assert param.split(".")[0] in err["message"], f"{what}: the message names the field: {err}"
    if code is not None:
        assert err["code"] == code, f"{what}: {err}"
    return err


# --- 1. the reference ------------------------------------------------------------------------


def test_greedy_answer_before_fuzzing_matches_transformers(tiny_model, greedy_before):
    tokens, text = greedy_before
    assert tokens == hf_greedy(load_hf(tiny_model), [PROMPT_IDS], MAX_NEW)[0]
    assert text


# --- 2. schemathesis from the router's own document -------------------------------------------


def test_openapi_document_describes_the_public_api(cluster):
    r = httpx.get(cluster.url + "/openapi.json", timeout=TIMEOUT)
    expect(r, 401, code="invalid_api_key", what="no API key")
    doc = cluster.client.get("/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    assert {p: set(ops) for p, ops in doc["paths"].items()} == {
        CHAT: {"post"},
        COMPLETIONS: {"post"},
        GENERATE: {"post"},
        "/v1/models": {"get"},
        "/tokenize": {"post"},
        "/detokenize": {"post"},
        "/health": {"get"},
    }
    schemas = doc["components"]["schemas"]
    for name, model in (("ChatRequest", ChatRequest), ("CompletionRequest", CompletionRequest)):
        props = schemas[name]["properties"]
        assert set(props) == set(model.model_fields) | set(model.UNSUPPORTED), (
            f"{name} is the validating model, with its refused fields"
        )
        assert schemas[name]["additionalProperties"] is False
        assert props["model"]["enum"] == [cluster.model]
        assert props["max_tokens"]["anyOf"][0]["maximum"] == CONTEXT - 1
    assert doc["paths"][CHAT]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
    schemathesis.openapi.from_dict(doc).validate()  # against the OpenAPI 3.1 meta-schema


@pytest.fixture(scope="module")
def api_schema(cluster):
    return schemathesis.openapi.from_url(cluster.url + "/openapi.json", headers=AUTH)


def _fuzz(operation, mode: GenerationMode, examples: int, check) -> None:
    # The Authorization header is fixed, so negative cases break the body, not the key.
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(case=operation.as_strategy(generation_mode=mode, headers=AUTH))
    def run(case):
        check(case)

    run()


def _whole_floats_as_ints(value):
    """JSON Schema counts 8.0 as an integer and schemathesis sends some integers that way; the
    router's types are strict (8.0 is a 400, tested by hand below), so they are sent as 8 here."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    return value


def _short(body: dict, path: str) -> None:
    """At most 8 new tokens per valid case (the tiny model on two cores is the budget)."""
    params = body if path != GENERATE else body.setdefault("sampling_params", {})
    keys = ("max_tokens", "max_completion_tokens") if path == CHAT else ("max_tokens",)
    for key in keys:
        if isinstance(params.get(key), int):
            params[key] = min(params[key], MAX_NEW)
    if all(params.get(k) is None for k in keys):
        params["max_tokens"] = MAX_NEW


def _refusal_the_schema_cannot_state(path: str, body: dict, r) -> str | None:
    """A valid-looking request may still be refused for reasons counted in tokens or in the
    model's vocabulary, which the router does not know: only those, with the OpenAI body."""
    if r.status_code != 400:
        return None
    err = r.json()["error"]
    if err["code"] == "context_length_exceeded":
        return "prompt + max_tokens over the context"
    ids = body.get("input_ids") if path == GENERATE else body.get("prompt")
    if err["param"] == "input_ids" and isinstance(ids, list):
        return "token ids beyond the vocabulary"
    if path == "/detokenize" and err["param"] == "tokens":
        return "token ids beyond the vocabulary"
    guided = ("response_format", "guided_json", "guided_regex", "guided_choice")
    if err["param"] in guided and body.get(err["param"]) is not None:
        return "a schema or regex that does not compile (only the grammar engine can tell)"
    if err["param"] == "best_of" and body.get("best_of") != (body.get("n") or 1):
        return "best_of other than n (JSON Schema cannot relate two fields)"
    if err["code"] == "invalid_value" and err["message"].startswith("at most one of"):
        return "two guides at once (JSON Schema cannot say 'at most one of these fields')"
    if err["param"] == "tools" and "no tool support" in err["message"]:
        return "tools for a model whose chat template takes none (the node knows)"
    if err["param"] == "tool_choice":
        return "a tool_choice that needs tools, names none of them, or meets a guide"
    if str(err["param"]).endswith((".tool_calls", ".tool_call_id")) and "only on" in err["message"]:
        return "tool_calls or tool_call_id on a message of another role"
    return None


POSITIVE_EXAMPLES = {
    CHAT: 12,
    COMPLETIONS: 12,
    GENERATE: 12,
    "/v1/models": 3,
    "/health": 1,
    "/tokenize": 8,
    "/detokenize": 8,
}
NEGATIVE_EXAMPLES = 25


def test_schemathesis_valid_cases_are_served_as_documented(cluster, api_schema):
    response_checks = [
        st_checks.not_a_server_error,
        st_checks.status_code_conformance,
        st_checks.content_type_conformance,
        st_checks.response_schema_conformance,
    ]
    served: dict[str, list[int]] = {}
    for result in api_schema.get_all_operations():
        op = result.ok()
        statuses = served.setdefault(op.path, [])

        def check(case, path=op.path, statuses=statuses):
            if isinstance(case.body, dict):
                case.body = _whole_floats_as_ints(case.body)
                if path in POSTS:
                    _short(case.body, path)
            r = case.call(base_url=cluster.url, timeout=TIMEOUT)
            case.validate_response(r, checks=response_checks)
            statuses.append(r.status_code)
            if r.status_code != 200:
                assert _refusal_the_schema_cannot_state(path, case.body, r), (
                    f"valid case refused: {r.status_code} {r.text[:300]}"
                )

        _fuzz(op, GenerationMode.POSITIVE, POSITIVE_EXAMPLES[op.path], check)
    assert set(served) == set(POSITIVE_EXAMPLES)
    for path, statuses in served.items():
        assert statuses.count(200) * 3 >= len(statuses) > 0, f"{path}: mostly refused {statuses}"
        if path in POSTS:
            assert len(statuses) * 2 >= POSITIVE_EXAMPLES[path], f"{path}: few cases {statuses}"


def test_schemathesis_invalid_cases_get_4xx(cluster, api_schema):
    response_checks = [
        st_checks.not_a_server_error,
        st_checks.negative_data_rejection,
        st_checks.status_code_conformance,
        st_checks.content_type_conformance,
        st_checks.response_schema_conformance,
    ]
    statuses: list[int] = []

    def check(case):
        r = case.call(base_url=cluster.url, timeout=TIMEOUT)
        case.validate_response(r, checks=response_checks)
        assert 400 <= r.status_code < 500, f"{r.status_code} {r.text[:300]}"
        openai_error(r.json())
        statuses.append(r.status_code)

    for path in (*POSTS, "/tokenize", "/detokenize"):
        _fuzz(api_schema[path]["POST"], GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES, check)
    assert len(statuses) >= 2 * NEGATIVE_EXAMPLES  # hypothesis may stop early on small spaces


# --- 3. hand-written bad input ----------------------------------------------------------------


def chat_body(c: Cluster, **kw) -> dict:
    return {"model": c.model, "messages": CHAT_PROMPT, "max_tokens": 2, **kw}


def completion_body(c: Cluster, **kw) -> dict:
    return {"model": c.model, "prompt": "the cache", "max_tokens": 2, **kw}


def valid_body(c: Cluster, path: str) -> dict:
    if path == GENERATE:
        return {"text": "the cache", "sampling_params": {"max_tokens": 2}}
    return chat_body(c) if path == CHAT else completion_body(c)


def nested(depth: int) -> dict:
    value: dict = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


def test_huge_bodies_get_413_and_long_prompts_400(cluster):
    twenty_mb = json.dumps(
        chat_body(cluster, messages=[{"role": "user", "content": "x" * (20 << 20)}])
    ).encode()
    for path in POSTS:
        expect(post(cluster, path, content=twenty_mb), 413, code="body_too_large", what=path)

    def chunks():  # no Content-Length: the router counts while it reads
        for _ in range(20):
            yield b" " * (1 << 20)

    expect(post(cluster, CHAT, content=chunks()), 413, code="body_too_large", what="chunked")
    # Far over the 256-token context, but under the body limit: the node counts and refuses.
    words = "the cache page token " * 20_000
    for path, body in (
        (CHAT, chat_body(cluster, messages=[{"role": "user", "content": words}])),
        (COMPLETIONS, completion_body(cluster, prompt=words)),
        (COMPLETIONS, completion_body(cluster, prompt=[5] * 100_000, stream=True)),
        (GENERATE, {"input_ids": [5] * 100_000, "stream": True}),
    ):
        expect(post(cluster, path, json=body), 400, code="context_length_exceeded", what=path)


MALFORMED = {
    "array nested 100k deep": (b"[" * 100_000 + b"]" * 100_000, {}, 400, None),
    "object nested 100k deep": (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, {}, 400, None),
    "invalid UTF-8": (
        b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        {},
        400,
        None,
    ),
    "truncated UTF-8": (b'{"prompt": "\xe2\x82"}', {}, 400, None),
    "UTF-8 encoded surrogate": (b'{"prompt": "\xed\xa0\x80"}', {}, 400, None),
    "not JSON": (b"hello", {}, 400, None),
    "empty body": (b"", {}, 400, None),
    "truncated JSON": (b'{"model": "m", "messages": [', {}, 400, None),
    "trailing garbage": (b'{"model": "m"} {}', {}, 400, None),
    "a JSON array": (b"[]", {}, 400, None),
    "JSON null": (b"null", {}, 400, None),
    "a JSON number": (b"42", {}, 400, None),
    "text/plain": (None, {"content-type": "text/plain"}, 415, "Content-Type"),
    "form-urlencoded": (
        None,
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        "Content-Type",
    ),
    "multipart": (None, {"content-type": "multipart/form-data; boundary=x"}, 415, "Content-Type"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_bodies_get_4xx(cluster, case):
    content, headers, status, param = MALFORMED[case]
    for path in POSTS:
        body = content if content is not None else json.dumps(valid_body(cluster, path)).encode()
        expect(
            post(cluster, path, content=body, headers=headers),
            status,
            param=param,
            what=f"{case} on {path}",
        )


def test_json_content_type_with_charset_and_nesting_up_to_the_limit_are_accepted(cluster):
    for path in POSTS:
        r = post(
            cluster,
            path,
            content=json.dumps(valid_body(cluster, path)).encode(),
            headers={"content-type": "application/json; charset=utf-8"},
        )
        assert r.status_code == 200, r.text
    # The body is depth 1, so a field may hold 63 levels; one more is refused. /generate passes
    # unknown top-level fields on to the nodes (which ignore them); the OpenAI routes refuse them
    # (after the depth check: the JSON parser counts levels before any field is looked at).
    native = {"text": "the cache", "sampling_params": {"max_tokens": 2}}
    assert post(cluster, GENERATE, json={**native, "extra": nested(63)}).status_code == 200
    expect(
        post(cluster, CHAT, json=chat_body(cluster, extra=nested(63))),
        400,
        param="extra",
        code="unsupported_parameter",
    )
    for path, body in ((GENERATE, native), (CHAT, chat_body(cluster))):
        err = expect(
            post(cluster, path, json={**body, "extra": nested(64)}), 400, code="invalid_json"
        )
        assert "nested deeper than 64" in err["message"]


def test_lone_surrogates_and_non_finite_numbers_name_the_field(cluster):
    surrogate = json.dumps(chat_body(cluster, messages=[{"role": "user", "content": "a\ud800"}]))
    expect(post(cluster, CHAT, content=surrogate.encode()), 400, param="messages.0.content")
    native = '{"text": "a", "sampling_params": {"temperature": %s}}'
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        expect(
            post(cluster, GENERATE, content=(native % literal).encode()),
            400,
            param="sampling_params.temperature",
            what=literal,
        )
        body = json.dumps(completion_body(cluster)).replace(
            '"max_tokens": 2', f'"top_p": {literal}'
        )
        expect(post(cluster, COMPLETIONS, content=body.encode()), 400, param="top_p", what=literal)


# Numbers each field must refuse (`top_k` = -1 means "off", so -2 is the negative one).
BAD_NUMBERS = [
    "-2",
    "NaN",
    "Infinity",
    "-Infinity",
    "1e999",
    str(10**30),
    str(2**64),
    "0.5",
    "8.0",
    '"1"',
    "true",
    "[1]",
    '{"v": 1}',
]
NUMBER_FIELDS = {
    CHAT: [
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "n",
        "best_of",
        "seed",
        "top_logprobs",
        "top_k",
        "min_p",
    ],
    COMPLETIONS: [
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "best_of",
        "seed",
        "logprobs",
        "top_k",
        "min_p",
    ],
}
FLOAT_FIELDS = {"temperature", "top_p", "min_p"}  # 0.5 is fine there


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_bad_numbers_name_the_field(cluster, path):
    failures = []
    for field in NUMBER_FIELDS[path]:
        for literal in BAD_NUMBERS:
            if field in FLOAT_FIELDS and literal == "0.5":
                continue
            body = {k: v for k, v in valid_body(cluster, path).items() if k != field}
            raw = json.dumps(body)[:-1] + f', "{field}": {literal}}}'
            r = post(cluster, path, content=raw.encode())
            ok = (
                r.status_code == 400
                and r.json()["error"]["param"] == field
                and field in r.json()["error"]["message"]
            )
            if not ok:
                failures.append((field, literal, r.status_code, r.text[:200]))
    assert not failures, failures


# One or more values of a wrong type (or shape) for every field of each OpenAI request model.
WRONG = {
    "model": [5, ["m"], None, {"id": "m"}],
    "messages": [
        "hi",
        {"role": "user"},
        [5],
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}],
        [{"role": "user", "content": "x", "tool_calls": []}],
    ],
    "prompt": [5, None, {"text": "x"}, [1.5], [True], [[1], [2]], [["a"]]],
    "stream": ["true", 1, None],
    "stream_options": ["yes", [True], {"include_usage": "yes"}],
    "max_tokens": ["8"],
    "max_completion_tokens": [[8]],
    "temperature": ["0"],
    "top_p": [[]],
    "seed": [{}],
    "n": ["1", 0, 17],
    "priority": ["1", 1.5, 2**31],
    "best_of": [1.5, 0, 17],
    "top_k": [1.5],
    "min_p": ["x"],
    "top_logprobs": [True],
    "user": [5, ["u"]],
    "safety_identifier": [True],
    "stop": [5, [5], [""], ["a"] * 17, {"s": "x"}],
    "stop_token_ids": [5, ["a"], [-1], [True]],
    "ignore_eos": ["no", 0],
    "return_tokens_as_token_ids": ["yes", 1],
    "logprobs": [{"n": 1}],
    "presence_penalty": ["0.5", 3.0],
    "frequency_penalty": [[0], -2.5],
    "repetition_penalty": [0, "1.1"],
    "logit_bias": [[1], {"x": 1}, {"5": 101}],
    "response_format": ["json", {"type": "xml"}, {"type": "json_schema"}],
    "guided_json": [5],
    "guided_regex": [5, ["a"]],
    "guided_choice": ["yes", [], [5]],
    "tools": [{"type": "function"}, [{"type": "function", "function": {"name": "a b"}}], "x"],
    "tool_choice": ["always", {"type": "function"}, 5],
    "parallel_tool_calls": ["no", 0],
}


@pytest.mark.parametrize("path, model", [(CHAT, ChatRequest), (COMPLETIONS, CompletionRequest)])
def test_wrong_types_for_every_field_name_it(cluster, path, model):
    assert set(model.model_fields) <= set(WRONG), "a new field needs its wrong values here"
    failures = []
    for field in model.model_fields:
        for value in WRONG[field]:
            body = {**valid_body(cluster, path), field: value}
            r = post(cluster, path, json=body)
            param = r.json()["error"]["param"] if r.status_code == 400 else None
            if (
                r.status_code != 400
                or not (param or "").startswith(field)
                or field not in r.json()["error"]["message"]
            ):
                failures.append((field, value, r.status_code, r.text[:200]))
    assert not failures, failures


def test_empty_and_missing_fields_name_the_field(cluster):
    m = cluster.model
    for path, body, param in [
        (CHAT, {"model": m, "messages": []}, "messages"),
        (CHAT, {"model": m}, "messages"),
        (CHAT, {"messages": CHAT_PROMPT}, "model"),
        (CHAT, {}, "model"),
        (COMPLETIONS, {"model": m, "prompt": ""}, "prompt"),
        (COMPLETIONS, {"model": m, "prompt": []}, "prompt"),
        (COMPLETIONS, {"model": m, "prompt": [[]]}, "prompt"),
        (COMPLETIONS, {"model": m}, "prompt"),
        (GENERATE, {}, "text"),
        (GENERATE, {"text": ""}, "text"),
        (GENERATE, {"input_ids": []}, "input_ids"),
        (GENERATE, {"messages": []}, "messages"),
    ]:
        expect(post(cluster, path, json=body), 400, param=param, what=f"{path} {body}")
    expect(
        post(cluster, CHAT, json=chat_body(cluster, model="no-such-model")),
        404,
        param="model",
        code="model_not_found",
    )


def test_unknown_and_unsupported_fields_are_refused_neutral_ones_change_nothing(cluster):
    greedy = chat_body(cluster, temperature=0, max_tokens=MAX_NEW)
    plain = post(cluster, CHAT, json=greedy)
    neutral = post(
        cluster,
        CHAT,
        json={
            **greedy,
            "user": "u1",
            "tools": [],
            "logit_bias": {},
            "n": 1,
            "presence_penalty": 0,
            "stream_options": None,
        },
    )
    assert plain.status_code == neutral.status_code == 200, neutral.text
    text = plain.json()["choices"][0]["message"]["content"]
    assert neutral.json()["choices"][0]["message"]["content"] == text
    for field, value in (
        ("use_beam_search", True),
        ("functions", [{"name": "f"}]),
        ("frobnicate", {"deep": [1, {"x": None}]}),
    ):
        expect(
            post(cluster, CHAT, json={**greedy, field: value}),
            400,
            param=field,
            code="unsupported_parameter",
        )
    expect(  # implemented now: a bad tool is a bad value
        post(cluster, CHAT, json={**greedy, "tools": [{"type": "function"}]}),
        400,
        param="tools.0.function",
        code="invalid_value",
    )
    r = post(
        cluster,
        GENERATE,
        json={"input_ids": PROMPT_IDS, "unknown": [1, 2], "sampling_params": {"max_tokens": 2}},
    )
    assert r.status_code == 200, r.text


def test_native_generate_bad_input_names_the_field(cluster):
    for body, param in [
        ({"text": "a", "input_ids": [1]}, "text"),
        ({"text": "a", "sampling_params": [1]}, "sampling_params"),
        ({"text": "a", "stream": "yes"}, "stream"),
        ({"text": 5}, "text"),
        ({"input_ids": [-1]}, "input_ids"),
        ({"input_ids": [10**30]}, "input_ids"),
        ({"input_ids": [1.5]}, "input_ids"),
        ({"messages": [{"role": 1, "content": "x"}]}, "messages"),
        ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"text": "a", "sampling_params": {"max_tokens": 10**30}}, "max_tokens"),
        ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"text": "a", "sampling_params": {"top_k": 2**64}}, "top_k"),
        ({"text": "a", "sampling_params": {"seed": 2**64}}, "seed"),
        ({"text": "a", "sampling_params": {"stop_token_ids": [2**64]}}, "stop_token_ids"),
        ({"text": "a", "sampling_params": {"ignore_eos": 2**64}}, "ignore_eos"),
        ({"text": "a", "sampling_params": {"logprobs": "yes"}}, "logprobs"),
        ({"text": "a", "sampling_params": {"top_logprobs": 21}}, "top_logprobs"),
        ({"text": "a", "sampling_params": {"top_logprobs": 2}}, "top_logprobs"),
    ]:
        for stream in (False, True):
            expect(
                post(cluster, GENERATE, json={**body, "stream": body.get("stream", stream)}),
                400,
                param=param,
                what=f"{body} stream={stream}",
            )


def test_tiny_temperatures_are_greedy_not_a_dead_rank(cluster, greedy_before):
    """logits / 1e-110 is inf in float32: this used to kill the node's rank (NaN probabilities)."""
    for temperature in (1e-110, 5e-324, 1e-6):
        r = post(
            cluster,
            GENERATE,
            json={
                "input_ids": PROMPT_IDS,
                "sampling_params": {
                    "max_tokens": MAX_NEW,
                    "ignore_eos": True,
                    "temperature": temperature,
                },
            },
        )
        assert r.status_code == 200 and r.json()["token_ids"] == greedy_before[0], r.text
        r = post(
            cluster, CHAT, json=chat_body(cluster, temperature=temperature, max_tokens=MAX_NEW)
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy_before[1]


def test_streaming_requests_with_bad_params_get_a_json_4xx_not_a_stream(cluster):
    for path, body, status, param in [
        (CHAT, chat_body(cluster, temperature=-1), 400, "temperature"),
        (CHAT, chat_body(cluster, max_tokens=0), 400, "max_tokens"),
        (CHAT, chat_body(cluster, max_tokens=10**6), 400, "max_tokens"),
        (CHAT, chat_body(cluster, n=17), 400, "n"),
        (CHAT, chat_body(cluster, n=2, best_of=3), 400, "best_of"),
        (CHAT, chat_body(cluster, guided_grammar="root ::= 'a'"), 400, "guided_grammar"),
        (
            CHAT,
            chat_body(cluster, stream_options={"include_usage": "yes"}),
            400,
            "stream_options.include_usage",
        ),
        (CHAT, chat_body(cluster, model="nope"), 404, "model"),
        (COMPLETIONS, completion_body(cluster, top_p=0), 400, "top_p"),
        (COMPLETIONS, completion_body(cluster, stop_token_ids=[2**64]), 400, "stop_token_ids.0"),
        (COMPLETIONS, completion_body(cluster, prompt=[1] * 300), 400, "max_tokens"),
    ]:
        with cluster.client.stream("POST", path, json={**body, "stream": True}) as r:
            r.read()
        expect(r, status, param=param, what=f"{path} {body}")


def _router_requests(c: Cluster) -> dict[tuple[str, str], float]:
    samples = parse(c.client.get("/metrics").text).get("pdserve_router_requests_total", [])
    return {(lab["route"], lab["status"]): v for lab, v in samples}


def _leave_mid_body(c: Cluster, path: str, chunked: bool) -> None:
    host, port = c.url.removeprefix("http://").split(":")
    length = "Transfer-Encoding: chunked" if chunked else "Content-Length: 100000"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\n{length}\r\n\r\n"
    ).encode()
    part = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 1000
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(head + (b"%x\r\n" % len(part) + part + b"\r\n" if chunked else part))
        time.sleep(0.2)  # let the router start reading, then go away


def test_client_that_leaves_mid_body_is_counted_499_not_500(cluster):
    before = _router_requests(cluster)
    for path, chunked in ((CHAT, False), (COMPLETIONS, True), (GENERATE, False)):
        _leave_mid_body(cluster, path, chunked)
    deadline = time.monotonic() + TIMEOUT
    while True:
        after = _router_requests(cluster)
        left = {p: after.get((p, "499"), 0) - before.get((p, "499"), 0) for p in POSTS}
        if all(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left == {CHAT: 1, COMPLETIONS: 1, GENERATE: 1}, left
    assert post(cluster, CHAT, json=chat_body(cluster)).status_code == 200


# --- 4. the cluster after all of it -------------------------------------------------------------


def test_cluster_still_serves_the_same_greedy_answer_after_bad_input(cluster, greedy_before):
    health = cluster.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    for node in cluster.nodes:
        assert httpx.get(node + "/health", timeout=TIMEOUT).status_code == 200
    assert greedy_answers(cluster) == greedy_before
    held = wait_pages_free(*cluster.nodes)
    assert not any(any(pages) for pages in held.values()), f"KV pages still held: {held}"
    server_errors = {k: v for k, v in _router_requests(cluster).items() if k[1].startswith("5")}
    assert not server_errors, f"the router answered 5xx: {server_errors}"
    for log in cluster.logs:
        text = log.read_text(errors="replace")
        assert " stops: " not in text, f"a rank died:\n{text[-3000:]}"
        assert not _tracebacks(text), f"{log.name}: {_tracebacks(text)}"


def _tracebacks(log: str) -> list[str]:
    """The exception line of each traceback in a log."""
    found, lines = [], log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last)"):
            end = next(
                (j for j in range(i + 1, len(lines)) if not lines[j].startswith(" ")),
                len(lines) - 1,
            )
            found.append(lines[end])
    return found
