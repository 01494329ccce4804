"""Structured output (engine/grammar.py): every guided greedy output parses and validates, on the
offline engine and on PD nodes (layouts (2,2) and (1,3), rank consensus checker on), and the PD
output equals the offline engine's for the same request."""

from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import jsonschema
import pytest
from pd_cluster import decode_node, prefill_node
from test_engine import make

from engine.core import ParamError, SamplingParams

SCHEMAS = {
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"admin": {"type": "boolean"}, "role": {"enum": ["dev", "ops"]}},
                "required": ["admin", "role"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
}
# The requests queue behind each other on a loaded machine (see tests/test_pd_nodes.py).
QUEUE_TIMEOUTS = {"PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "60", "PDSERVE_KV_WAITING_TIMEOUT_S": "60"}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


def guided(kind: str, spec: str, max_tokens: int = 96) -> dict:
    return {"max_tokens": max_tokens, "guide": [kind, spec]}


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make(tiny_model)


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate(engine, name):
    sp = SamplingParams.from_dict(guided("json_schema", json.dumps(SCHEMAS[name])))
    for out in engine.generate(PROMPTS, sp):
        assert out.finish_reason.kind == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_choice_and_regex(engine):
    choices = ["yes", "no", "maybe later"]
    sp = SamplingParams.from_dict(guided("choice", json.dumps(choices)))
    assert all(o.text in choices for o in engine.generate(PROMPTS, sp))
    sp = SamplingParams.from_dict(guided("regex", "[a-c]{3}-[0-9]{2}"))
    assert all(re.fullmatch("[a-c]{3}-[0-9]{2}", o.text) for o in engine.generate(PROMPTS, sp))


def test_unguided_output_is_not_json(engine):
    """The guide is what makes the outputs above valid: the same prompts without one are not."""
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=32))
    for o in outs:
        with pytest.raises(ValueError):
            json.loads(o.text)


@pytest.mark.parametrize(
    "guide",
    [
        ["json_schema", "{not json"],
        ["json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})],
        ["regex", "(unclosed"],
        ["choice", "[]"],
        ["grammar", "x"],
        "json_object",
    ],
)
def test_a_bad_guide_names_the_field(guide):
    with pytest.raises(ParamError) as e:
        SamplingParams.from_dict({"guide": guide})
    assert e.value.field == "guide"


@pytest.mark.parametrize("ppp,dpp", [(2, 2), (1, 3)])
def test_pd_guided_outputs_validate_and_match_the_engine(ppp, dpp, tiny30, tmp_path):
    eng = make(tiny30)
    cases = [(ids, name) for name in SCHEMAS for ids in PROMPTS[:2]]
    want = [
        eng.generate(
            [ids], SamplingParams.from_dict(guided("json_schema", json.dumps(SCHEMAS[n])))
        )[0].token_ids
        for ids, n in cases
    ]
    with (
        prefill_node(tiny30, ppp, tmp_path, env=QUEUE_TIMEOUTS) as (purl, bport, _),
        decode_node(tiny30, dpp, tmp_path, env=QUEUE_TIMEOUTS) as (durl, _),
    ):

        async def run():
            async with httpx.AsyncClient(timeout=120) as c:
                r = await c.put(
                    f"{durl}/bootstrap_servers", json={"servers": [f"127.0.0.1:{bport}"]}
                )
                assert r.status_code == 200

                async def one(ids, name):
                    b = {
                        "input_ids": ids,
                        "bootstrap_room": random.getrandbits(63),
                        "bootstrap_host": "127.0.0.1",
                        "bootstrap_port": bport,
                        "sampling_params": guided("json_schema", json.dumps(SCHEMAS[name])),
                    }
                    p, d = await asyncio.gather(
                        c.post(f"{purl}/generate", json=b), c.post(f"{durl}/generate", json=b)
                    )
                    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
                    return d.json()

                return await asyncio.gather(*(one(ids, n) for ids, n in cases))

        got = asyncio.run(run())
    for (_, name), g, w in zip(cases, got, want, strict=True):
        jsonschema.validate(json.loads(g["text"]), SCHEMAS[name])
        assert g["token_ids"] == w
    for name in ("prefill", "decode"):
        assert "diverged" not in (tmp_path / f"{name}.log").read_text()
