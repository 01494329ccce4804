"""The offline engine on a real (tiny) model: batching, seeds, prefix cache, retraction,
validation."""

from __future__ import annotations

import random

import pytest
from reference import hf_greedy, load_hf

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import ParamError, SamplingParams
from pdserve.engine.engine import Engine

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)


def make(model, **kw) -> Engine:
    base = dict(
        model=str(model),
        page_size=4,
        chunk_size=16,
        max_batch_tokens=64,
        max_total_tokens=4096,
        max_running=64,
        threads=1,
    )
    return Engine(EngineConfig(**{**base, **kw}))


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads():
    """The engines here set torch to 1 thread; later modules in this process get theirs back."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make(tiny_model)


@pytest.fixture(scope="module")
def reference(tiny_model, mixed_prompts):
    return hf_greedy(load_hf(tiny_model), mixed_prompts, MAX_NEW)


def test_one_batch_of_16_matches_transformers(engine, mixed_prompts, reference):
    assert any(len(p) > 32 for p in mixed_prompts), (
        "some prompts must take more than two chunks of 16"
    )
    outs = engine.generate(mixed_prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.held_pages() == 0


def test_alone_equals_inside_a_batch_of_32_and_seeds_repeat(engine, mixed_prompts):
    rng = random.Random(1)
    batch = [mixed_prompts[i % 16] for i in range(32)]
    params = [
        SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i)
        for i in range(32)
    ]
    together = engine.generate(batch, params)
    for i in rng.sample(range(32), 4):
        alone = engine.generate([batch[i]], params[i])[0]
        assert alone.token_ids == together[i].token_ids, i
    again = engine.generate(batch[:4], params[:4])
    assert [o.token_ids for o in again] == [o.token_ids for o in together[:4]]
    reseeded = engine.generate(
        batch[:4],
        [
            SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.9, top_k=50, seed=7 + i)
            for i in range(4)
        ],
    )
    assert [o.token_ids for o in reseeded] != [o.token_ids for o in together[:4]], (
        "seeds must matter"
    )


def test_prefix_cache_reuses_pages_and_keeps_outputs(tiny_model, mixed_prompts):
    shared = mixed_prompts[12][:64]  # 16 pages of 4 tokens
    first, second = shared + [7, 8, 9], shared + [10, 11]
    with_cache = make(tiny_model)
    without = make(tiny_model, enable_prefix_cache=False)
    a = with_cache.generate([first], GREEDY)[0]
    hits_before = with_cache.scheduler.cache.hit_tokens_total
    b = with_cache.generate([second], GREEDY)[0]
    assert with_cache.scheduler.cache.hit_tokens_total - hits_before == 64
    assert b.token_ids == without.generate([second], GREEDY)[0].token_ids
    assert a.token_ids == without.generate([first], GREEDY)[0].token_ids
    assert with_cache.scheduler.held_pages() == 0 and without.scheduler.held_pages() == 0
    with_cache.scheduler.cache.check_integrity()


def test_retraction_with_a_small_pool_still_completes_correctly(
    tiny_model, mixed_prompts, reference
):
    small = make(tiny_model, max_total_tokens=240)  # 60 pages: far less than 16 requests need
    outs = small.generate(mixed_prompts, GREEDY)
    assert small.scheduler.num_retractions > 0
    assert [o.token_ids for o in outs] == reference
    assert small.scheduler.held_pages() == 0


def test_stop_strings_stop_tokens_and_logprobs(engine, mixed_prompts, reference):
    stop_tok = reference[0][3]
    o = engine.generate(
        [mixed_prompts[0]], SamplingParams(max_tokens=MAX_NEW, stop_token_ids=(stop_tok,))
    )[0]
    assert o.token_ids == reference[0][:4] and o.finish_reason.kind == "stop"
    o = engine.generate(
        [mixed_prompts[1]],
        SamplingParams(max_tokens=4, logprobs=True, top_logprobs=3, ignore_eos=True),
    )[0]
    assert len(o.logprobs) == 4 and all(lp <= 0 for lp in o.logprobs)
    assert all(
        len(t) == 3 and t[0][0] == tok for t, tok in zip(o.top_logprobs, o.token_ids, strict=True)
    )
    text = engine.tokenizer.decode(reference[2], skip_special_tokens=True)
    if len(text) > 4:
        stop = text[2:4]
        o = engine.generate(
            [mixed_prompts[2]], SamplingParams(max_tokens=MAX_NEW, stop=(stop,), ignore_eos=True)
        )[0]
        assert o.finish_reason.kind == "stop" and stop not in o.text


def test_streaming_interface_yields_every_token(engine, mixed_prompts, reference):
    evs = list(engine.stream(mixed_prompts[4], GREEDY))
    assert [t for ev in evs for t in ev.new_token_ids] == reference[4]
    assert evs[-1].finished and evs[-1].finish_reason.kind == "length"


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": 0}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"min_p": 2}, "min_p"),
        ({"stop": 5}, "stop"),
        ({"temperature": float("nan")}, "temperature"),
        ({"bogus": 1}, "bogus"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
    ],
)
def test_invalid_sampling_params_name_the_field(engine, bad, field):
    with pytest.raises(ParamError) as e:
        engine.add_request([1, 2, 3], SamplingParams.from_dict(bad))
    assert e.value.field == field and field in str(e.value)


def test_streamed_text_never_shows_a_completed_stop_string(engine):
    """The front's incremental detokenizer: whether the tokens arrive one by one or all at once, the
    text sent is what precedes the stop string, even when the token completing the stop string
    arrives in the same chunk as the text before it."""
    from pdserve.engine.model.detokenizer import IncrementalDetokenizer

    tok = engine.tokenizer
    ids = tok.encode("alpha beta gamma delta epsilon", add_special_tokens=False)
    full = tok.decode(ids, skip_special_tokens=True)
    for stop in (" gamma", "ta gam", "a"):
        want = full[: full.find(stop)]
        for step in (1, 2, len(ids)):
            d = IncrementalDetokenizer(tok, (stop,))
            sent = ""
            for i in range(0, len(ids), step):
                sent += d.add(ids[i : i + step])
                assert not any(s in sent for s in (stop,)), (stop, step, sent)
            assert sent + d.finish(stop) == want, (stop, step)


def test_incremental_detokenizer_equals_a_full_decode():
    """The decode-stream path (one `tokenizers` step per token) sends exactly the text of a full
    decode, over 200 random token sequences of the default model's byte-level vocabulary (pieces of
    multi-byte characters included) and real multi-byte text, in random chunk sizes."""
    from pdserve.engine.model.detokenizer import IncrementalDetokenizer
    from pdserve.engine.model.loader import resolve_model
    from pdserve.engine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve_model(None))
    rng = random.Random(5)
    seqs = [
        [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 80))] for _ in range(200)
    ]
    text = "Ünïcode ✓ 漢字 and emoji 🙂🚀, code: x**2 → ∑"
    seqs.append(tok.encode(text, add_special_tokens=False))
    for ids in seqs:
        d = IncrementalDetokenizer(tok)
        assert d._stream is not None, "this tokenizer takes the decode-stream path"
        sent, i = "", 0
        while i < len(ids):
            n = rng.randrange(1, 5)
            sent += d.add(ids[i : i + n])
            i += n
        assert sent + d.finish(None) == tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(seqs[-1], skip_special_tokens=True) == text
