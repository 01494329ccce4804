"""Structured output (engine/grammar.py): every guided greedy output parses and validates, on the
offline engine and on PD nodes (layouts (2,2) and (1,3), ranks as threads, rank consensus checker
on), and the PD output equals the offline engine's for the same request."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import jsonschema
import pytest
from inproc import ColocatedCluster, PDCluster, running
from test_engine import make

from pdserve.engine.core import ParamError, Req, SamplingParams
from pdserve.runtime.messages import TokenEvent

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
def test_pd_guided_outputs_validate_and_match_the_engine(ppp, dpp, tiny6):
    """PD ranks as threads (tests/inproc.py), rank consensus checker on: the prefill side samples
    the first token under the grammar, the decode side's matcher starts from it."""
    eng = make(tiny6)
    cases = [(ids, name) for name in SCHEMAS for ids in PROMPTS[:2]]
    params = {n: guided("json_schema", json.dumps(SCHEMAS[n])) for n in SCHEMAS}
    want = [
        eng.generate([ids], SamplingParams.from_dict(params[n]))[0].token_ids for ids, n in cases
    ]
    with running(lambda: PDCluster(tiny6, ppp, dpp)) as c:
        rids = [f"g{i}" for i in range(len(cases))]
        for rid, (ids, n) in zip(rids, cases, strict=True):
            c.submit(rid, ids, params[n]["max_tokens"], ignore_eos=False, guide=params[n]["guide"])
        got = [c.result(rid) for rid in rids]
        c.wait_settled()
    for (_, name), g, w in zip(cases, got, want, strict=True):
        assert g.ok, g
        assert g.tokens == w
        jsonschema.validate(
            json.loads(eng.tokenizer.decode(g.tokens, skip_special_tokens=True)), SCHEMAS[name]
        )


def _fronts_and_samplers(c) -> tuple[Any, list]:
    """The front that answers a stream (the decode node's on PD) and every sampling rank's
    grammar sampler (a PD pair has two: the prefill side samples the first token)."""
    nodes = [c.node_] if isinstance(c, ColocatedCluster) else [c.prefill, c.decode]
    return nodes[-1].front, [n.loops[-1].runner.grammar for n in nodes]


@pytest.mark.parametrize("layout", ["colocated1", "colocated2", "colocated2-async1", "pd22"])
def test_a_guide_still_compiling_holds_back_its_request_only(layout, tiny6):
    """Every sampling rank's compile thread is held (a job waits on an event, queued ahead of the
    guide's compile). Unguided requests sent with a guided one all finish while the guided one has
    no token, its prompt computed but for the token that samples; once released, its output is
    the engine's. Before `guide_pending` the first sample waited for the compile, and with it
    every stream of the node (these waits time out)."""
    eng = make(tiny6)
    params = guided("json_schema", json.dumps(SCHEMAS["nested"]))
    want = eng.generate([PROMPTS[1]], SamplingParams.from_dict(params))[0].token_ids
    factory = {
        "colocated1": lambda: ColocatedCluster(tiny6, 1),
        "colocated2": lambda: ColocatedCluster(tiny6, 2),
        "colocated2-async1": lambda: ColocatedCluster(tiny6, 2, async_depth=1),
        "pd22": lambda: PDCluster(tiny6, 2, 2),
    }[layout]
    with running(factory) as c:
        front, samplers = _fronts_and_samplers(c)
        release = threading.Event()
        for g in samplers:
            g._pool.submit(release.wait, 60)
        try:
            c.submit("g", PROMPTS[1], params["max_tokens"], ignore_eos=False, guide=params["guide"])
            for i, ids in enumerate(PROMPTS):
                c.submit(f"p{i}", ids, 8)
            plain = [c.result(f"p{i}") for i in range(len(PROMPTS))]
            held = list(front.events.get("g", []))
            with c.paused():  # where the guided request is on the node that samples it first
                node = c.node_ if isinstance(c, ColocatedCluster) else c.prefill
                computed = [loop.sched.reqs["g"].kv_len for loop in node.loops]
        finally:
            release.set()
        got = c.result("g")
        c.wait_settled()
    assert all(p.ok and len(p.tokens) == 8 for p in plain), plain
    assert not any(isinstance(e, TokenEvent) or e.terminal for e in held), held
    assert computed == [len(PROMPTS[1]) - 1] * len(computed)
    assert got.ok and got.tokens == want


def test_more_pending_guides_than_the_cache_keeps_all_compile(engine, monkeypatch):
    """Each held request checks the compile it holds (`Req.guide_compile`). With more distinct
    guides pending than the sampling rank's cache keeps (MAX_COMPILED), preparing them again on
    every check evicted one another's compiles for ever, and none was ever reported done."""
    from pdserve.engine import grammar

    monkeypatch.setattr(grammar, "MAX_COMPILED", 2)
    cfg = engine.model_config
    g = grammar.GrammarSampler(lambda: engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    reqs = [
        Req(f"r{i}", [5, 6], SamplingParams.from_dict(guided("regex", f"a{i}+"))) for i in range(3)
    ]
    for r in reqs:
        grammar.hold_for_guide(r, engine.scheduler, g)
    done: list[str] = []
    deadline = time.monotonic() + 60
    while len(done) < len(reqs) and time.monotonic() < deadline:
        done = g.compiled(reqs)
        time.sleep(0.01)
    g.close()
    assert [rid for rid, _ in done] == ["r0", "r1", "r2"]
    assert all(n > 0 for _, n in done)  # each with its compiled grammar's bytes
    assert all(r.guide_pending for r in reqs)  # the report is the loops' to apply
    # a guide every rank knows compiled stays in the cache, whatever comes after it
    g = grammar.GrammarSampler(lambda: engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    known = ("regex", "k+")
    g.pinned = {known: None}
    for guide in [known, ("regex", "x+"), ("regex", "y+"), ("regex", "z+")]:
        g.prepare(guide)
    assert list(g._compiled) == [known, ("regex", "z+")]
    g.close()


def test_the_compiled_guide_cache_is_bounded_in_bytes(engine, monkeypatch):
    """The sampling rank's cache drops its oldest compiles that are not known guides while they
    hold more than MAX_COMPILED_BYTES (the newest stays); known guides stay whatever their bytes
    (bounded apart, engine/guide_hold.py). Before, it kept 256 whatever their bytes: a client's
    256 distinct 42 KB schemas held 1.7 GB there."""
    from pdserve.engine import grammar

    cfg = engine.model_config
    g = grammar.GrammarSampler(lambda: engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    guides = [("json_schema", json.dumps(SCHEMAS[n])) for n in SCHEMAS]  # three, distinct
    sizes = [grammar.compiled_bytes(g.prepare(x)) for x in guides if g.prepare(x).result()]
    assert all(n > 0 for n in sizes)
    monkeypatch.setattr(grammar, "MAX_COMPILED_BYTES", sizes[1] + sizes[2])
    g._compiled.clear()
    g._sizes.clear()
    known = ("regex", "k+")
    g.pinned = {known: 0}
    for guide in [known, *guides]:
        g.prepare(guide).result()
        g.compiled([])  # nothing pending: measuring happens as entries are kept
    g.prepare(("regex", "z+")).result()  # one more: the others now hold too much
    kept = list(g._compiled)
    g.close()
    assert kept[0] == known and kept[-1] == ("regex", "z+")
    assert guides[0] not in kept  # the oldest that is not known went
    total = sum(grammar.compiled_bytes(f) for x, f in g._compiled.items() if x != known)
    assert total <= sizes[1] + sizes[2] + grammar.compiled_bytes(g._compiled[("regex", "z+")])


def test_a_reported_guide_stays_cached_until_its_report_is_applied(engine, monkeypatch):
    """In a pipeline the report takes a turn of its slot to come round and make the guide known
    (pinned). Meanwhile the byte bound must not drop it: a later request with the guide would not
    be held, find no compile, and stall the step while it compiles again. Before `guides_awaited`
    a byte eviction in that window dropped it."""
    from pdserve.engine import grammar

    cfg = engine.model_config
    sched = engine.scheduler
    g = grammar.GrammarSampler(lambda: engine.tokenizer, cfg.vocab_size, cfg.eos_token_ids)
    big = ("json_schema", json.dumps(SCHEMAS["nested"]))
    a = Req("a", [5, 6], SamplingParams.from_dict({"max_tokens": 2, "guide": list(big)}))
    sched.add(a)
    grammar.hold_for_guide(a, sched, g)
    assert a.guide_pending and a.guide_compile is not None
    a.guide_compile.result()
    report = g.compiled([a])  # the sampling rank's report, not applied yet
    assert [rid for rid, _ in report] == ["a"]
    monkeypatch.setattr(grammar, "MAX_COMPILED_BYTES", 1)  # every other compile is too much
    for spec in ("x+", "y+"):
        g.prepare(("regex", spec)).result()
    g.prepare(("regex", "z+"))
    assert big in g._compiled, "the awaited guide was dropped before its report was applied"
    sched.guides_compiled(report)  # the report comes round: the guide is known now
    assert big in sched.guides_known and not a.guide_pending
    g.prepare(("regex", "w+"))
    assert big in g._compiled
    sched.abort("a")
    sched.drain_finished()
    g.close()


def test_a_guide_compiled_before_is_not_held_in_a_pipeline(tiny6):
    """Once a report named a guide, every rank knows it compiled (`guides_known`): a later request
    with it is not held, so its whole prompt and first sample go in its first forward, where a
    pipeline would otherwise wait a turn of its slot for the report to come round."""
    params = guided("json_schema", json.dumps(SCHEMAS["enum"]), max_tokens=24)
    with running(lambda: ColocatedCluster(tiny6, 2)) as c:
        c.submit("first", PROMPTS[0], 24, ignore_eos=False, guide=params["guide"])
        assert c.result("first").ok
        loops = c.node_.loops
        with c.stepping():
            c.submit("again", PROMPTS[1], 24, ignore_eos=False, guide=params["guide"])
            c.step_until(lambda: all("again" in loop.sched.reqs for loop in loops))
            reqs = [loop.sched.reqs["again"] for loop in loops]
            pending = [r.guide_pending for r in reqs]
            computed = [r.kv_len for r in reqs]
        again = c.result("again")
    assert pending == [False, False]
    assert computed == [len(PROMPTS[1])] * 2
    assert again.ok
