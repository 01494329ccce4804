"""A request resumed from tokens generated before (a migrated stream, router/routing/migration.py)
continues exactly as the undisturbed request did: the engine (greedy, seeded sampling with and
without filters, penalties and logit_bias, stop strings, logprobs, a JSON-schema grammar; in fp32,
and in bf16 with batch-invariant serving), and the front's detokenizer (the text after any chunk
boundary)."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine import make

from pdserve.engine.core import ParamError, SamplingParams
from pdserve.engine.model.detokenizer import IncrementalDetokenizer
from pdserve.engine.model.linear import batch_invariant_why_not

PROMPT = [5, 9, 13, 22, 31, 40, 41, 7]
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tag": {"enum": ["x", "yy", "zzz"]}},
    "required": ["n", "tag"],
    "additionalProperties": False,
}
CASES = {
    "greedy": dict(max_tokens=24, ignore_eos=True),
    "seeded": dict(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True),
    "seeded_filtered": dict(
        max_tokens=24, temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, seed=11, ignore_eos=True
    ),
    "penalties": dict(
        max_tokens=24,
        repetition_penalty=1.3,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        logit_bias={"7": 2.0, "11": -100.0},
        ignore_eos=True,
    ),
    "logprobs": dict(max_tokens=16, logprobs=True, top_logprobs=3, ignore_eos=True),
    "json_schema": dict(max_tokens=48, guide=["json_schema", json.dumps(SCHEMA)]),
}


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make(tiny_model)


def run(engine, params: dict, resume: list[int] = ()):
    """The request alone on the engine, to its end: its Req."""
    rid = engine.add_request(PROMPT, SamplingParams.from_dict(params), resume=resume)
    engine._done = {}
    while rid not in engine._done:
        engine.step()
    return engine._done.pop(rid)


def batch_invariant_bf16(model):
    """A bf16 engine of `model` with batch-invariant serving (skips where this CPU has none)."""
    why = batch_invariant_why_not(torch.bfloat16)
    if why:
        pytest.skip(f"no batch-invariant bf16 on this CPU: {why}")
    return make(model, dtype="bfloat16", batch_invariant=True)


@pytest.fixture(scope="module")
def bf16_engine(tiny_model):
    return batch_invariant_bf16(tiny_model)


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_continues_exactly(engine, case):
    check_resumes(engine, CASES[case], exact_logprobs=False)


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_bf16_request_continues_exactly_when_batch_invariant(bf16_engine, case):
    """The resume re-prefills prompt + tokens in chunks where the first run decoded them one at a
    time: in bf16 only a batch-invariant engine gives those tokens the same bits."""
    check_resumes(bf16_engine, CASES[case], exact_logprobs=True)


def check_resumes(engine, params: dict, exact_logprobs: bool) -> None:
    whole = run(engine, params)
    n = len(whole.output_ids)
    assert n >= 4, whole.output_ids
    for k in sorted({1, n // 2, n - 1, n}):  # n: cut after the last token, before its finish
        again = run(engine, params, whole.output_ids[:k])
        assert again.output_ids == whole.output_ids, k
        assert again.finish == whole.finish, k
        if params.get("logprobs"):
            # the resumed tokens' logprobs are the first node's; the rest are computed again
            got, want = again.output_logprobs, whole.output_logprobs[k:]
            assert got == (want if exact_logprobs else pytest.approx(want, abs=1e-4)), k
            tops = [[t for t, _ in top] for top in again.output_top_logprobs]
            assert tops == [[t for t, _ in top] for top in whole.output_top_logprobs[k:]]


def test_a_bf16_request_gets_the_same_bits_beside_any_batch_when_batch_invariant(bf16_engine):
    check_same_bits_beside_others(bf16_engine)


def check_same_bits_beside_others(engine) -> None:
    """The same request alone, then beside others that arrive at other steps (their prefill chunks
    and decodes share its forwards): the same tokens and bit-identical logprobs."""
    params = SamplingParams.from_dict(CASES["logprobs"])
    alone = run(engine, CASES["logprobs"])
    others = [[3 + i, 17, 29 + 2 * i] * (2 + 3 * i) for i in range(5)]
    engine._done = {}
    rid = None
    for step in range(200):
        if step < len(others):
            engine.add_request(others[step], SamplingParams(max_tokens=20 + step, ignore_eos=True))
        if step == 2:
            rid = engine.add_request(PROMPT, params)
        engine.step()
        if rid is not None and rid in engine._done and len(engine._done) == len(others) + 1:
            break
    beside = engine._done.pop(rid)
    assert beside.output_ids == alone.output_ids
    assert beside.output_logprobs == alone.output_logprobs  # bits, not approximately
    assert beside.output_top_logprobs == alone.output_top_logprobs


def test_a_stop_string_across_the_resume_point_still_ends_the_request(engine):
    whole = run(engine, CASES["greedy"])
    text = engine.tokenizer.decode(whole.output_ids, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    params = {**CASES["greedy"], "stop": [stop]}
    stopped = run(engine, params)
    assert stopped.finish.kind == "stop" and stopped.finish.matched == stop
    for k in range(1, len(stopped.output_ids) + 1):  # every cut, inside the stop string too
        again = run(engine, params, stopped.output_ids[:k])
        assert again.output_ids == stopped.output_ids and again.finish == stopped.finish, k


def test_batch_invariance_is_refused_where_no_kernel_gives_it(tiny_model):
    with pytest.raises(ValueError, match="float32"):
        make(tiny_model, dtype="float32", batch_invariant=True)


def test_a_resume_longer_than_max_tokens_is_refused(engine):
    with pytest.raises(ParamError) as e:
        engine.add_request(PROMPT, SamplingParams(max_tokens=3), resume=[1, 2, 3, 4])
    assert e.value.field == "resume"


def _chunked(tok, ids: list[int], sizes: list[int], stop=()) -> tuple[list[str], list[int]]:
    """The detokenizer's text per chunk, and the token count at each chunk's end."""
    d, texts, ends, i = IncrementalDetokenizer(tok, stop), [], [], 0
    for size in sizes:
        texts.append(d.add(ids[i : i + size]))
        i += size
        ends.append(i)
    texts.append(d.finish(None))
    return texts, ends


@pytest.mark.parametrize("stop", [(), ("zz",)])
def test_the_detokenizer_resumes_at_any_chunk_boundary(engine, stop):
    """Whatever the first node's chunks held back (an incomplete character, a possible stop
    string), the new node's text after the boundary is exactly the rest of the undisturbed text."""
    tok = engine.tokenizer
    ids = tok("Grüße, 東京! zzz — naïve café 😀 ok", add_special_tokens=False)["input_ids"]
    ids = ids + ids[::-1]
    sizes = [1, 2, 1, 3, 1, 1, 2] * len(ids)
    sizes = sizes[: next(i for i in range(len(sizes)) if sum(sizes[: i + 1]) >= len(ids)) + 1]
    texts, ends = _chunked(tok, ids, sizes, stop)
    whole = "".join(texts)
    for j, end in enumerate(ends[:-1]):
        sent = "".join(texts[: j + 1])
        d = IncrementalDetokenizer(tok, stop)
        d.resume(ids[:end], len(sent))
        rest = [d.add(ids[a:b]) for a, b in zip(ends[j:-1], ends[j + 1 :], strict=True)]
        assert sent + "".join(rest) + d.finish(None) == whole, j


def test_the_detokenizer_refuses_more_text_than_the_tokens_have(engine):
    d = IncrementalDetokenizer(engine.tokenizer)
    with pytest.raises(ValueError):
        d.resume(engine.tokenizer("ab", add_special_tokens=False)["input_ids"], 99)
