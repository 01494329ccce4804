"""Penalties and logit_bias against a transformers reference: the same model, greedy, with
transformers' own processors where it has them (SequenceBias, RepetitionPenalty) and OpenAI's
formula for frequency and presence penalties (transformers has no processor for them)."""

from __future__ import annotations

import pytest
import torch
from reference import load_hf
from test_engine import make

from pdserve.engine.core import SamplingParams

MAX_NEW = 16
CASES = {
    "repetition_1.5": dict(repetition_penalty=1.5),
    "repetition_0.7": dict(repetition_penalty=0.7),
    "frequency_1.0": dict(frequency_penalty=1.0),
    "presence_1.5": dict(presence_penalty=1.5),
    "presence_-0.5_frequency_0.3": dict(presence_penalty=-0.5, frequency_penalty=0.3),
    "bias": dict(logit_bias={"7": 5.0, "11": -100.0, "40": 2.5}),
    "all": dict(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.2,
        logit_bias={"7": 3.0},
    ),
}


@torch.inference_mode()
def hf_penalized_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    procs = []
    if params.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    ids, out = list(prompt), []
    for _ in range(MAX_NEW):
        logits = model(torch.tensor([ids])).logits[:, -1].float()
        for proc in procs:
            logits = proc(torch.tensor([ids]), logits)
        if out:
            counts = torch.bincount(torch.tensor(out), minlength=logits.shape[-1]).float()
            logits = logits - params.frequency_penalty * counts
            logits = logits - params.presence_penalty * (counts > 0).float()
        nxt = int(logits[0].argmax())
        ids.append(nxt)
        out.append(nxt)
    return out


@pytest.fixture(scope="module")
def hf(tiny_model):
    return load_hf(tiny_model)


@pytest.fixture(scope="module")
def engine(tiny_model):
    return make(tiny_model)


@pytest.mark.parametrize("case", list(CASES))
def test_penalties_match_transformers(engine, hf, mixed_prompts, case):
    params = SamplingParams.from_dict({"max_tokens": MAX_NEW, "ignore_eos": True, **CASES[case]})
    prompts = mixed_prompts[:4]
    got = [c.token_ids for c in engine.generate(prompts, params)]
    want = [hf_penalized_greedy(hf, p, params) for p in prompts]
    assert got == want
    plain = [
        c.token_ids
        for c in engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    ]
    assert got != plain, "the case changes nothing on these prompts: it tests nothing"


def test_params_round_trip_through_the_wire_form():
    p = SamplingParams.from_dict({"logit_bias": {"12": 1.5, "3": -2}, "presence_penalty": 0.5})
    assert p.logit_bias == ((3, -2), (12, 1.5))
    assert SamplingParams.from_dict(p.to_dict()) == p


def test_an_overflowing_penalty_never_kills_the_sampling_rank():
    """Found by the router fuzz test: repetition_penalty 1e-300 divides positive logits into inf,
    softmax gives NaN, and torch.multinomial raised in the rank's loop (the rank died). The row
    now falls back to its argmax."""
    from pdserve.engine.sampling import sample

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 5
    logits[0, 2] = logits[1, 4] = 3.0  # positive: divided by 1e-300, it overflows
    logits[0, 1], logits[0, 3] = -2.0, 1.0  # row 0: two overflow (2 and 3); 1 goes to about 0
    p = SamplingParams.from_dict({"temperature": 1.0, "repetition_penalty": 1e-300})
    out = sample(
        logits, [p, p], [0, 0], torch.Generator().manual_seed(0), [([1, 2], [3]), ([4], [])]
    )
    # Every overflowed logit becomes the largest float, so the rows can only take one of those:
    # row 0 token 2 or 3, row 1 token 4 (no other logit there comes near the largest float).
    assert out.token_ids[0] in (2, 3) and out.token_ids[1] == 4, out.token_ids
