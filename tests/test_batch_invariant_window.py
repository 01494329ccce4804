"""Batch-invariant bf16 serving of a sliding-window model: a tiny Gemma 3 (windows of 7 tokens on
three of its four layers, prompts and outputs well past them). Every token attends through the
decode kernel, told the window on the sliding layers (engine/forward_batch.py `one_token_group`):
- the window is applied: the chosen tokens' logprobs agree with transformers' fp32 logits of the
  model as it is, and are several times further from those of the same weights without the window;
- a request gets the same bits beside any batch, and a resumed request continues exactly, as
  tests/test_resume.py checks for a model without windows."""

from __future__ import annotations

import pytest
import torch
from test_resume import (
    CASES,
    PROMPT,
    batch_invariant_bf16,
    check_resumes,
    check_same_bits_beside_others,
    run,
)

from tests.test_model import hf_logits
from tests.tiny_model import GEMMA3_WINDOW, build_tiny_model


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gemma3") / "m", arch="gemma3", tie=True)


@pytest.fixture(scope="module")
def engine(gemma):
    return batch_invariant_bf16(gemma)


def test_the_window_is_applied(engine, gemma):
    done = run(engine, CASES["logprobs"])
    seq = PROMPT + done.output_ids
    assert len(seq) > 2 * GEMMA3_WINDOW
    (windowed,) = hf_logits(gemma, [seq])
    (unwindowed,) = hf_logits(gemma, [seq], sliding_window=10**6)

    def err(ref: torch.Tensor) -> float:
        logp = torch.log_softmax(ref, dim=-1)
        want = [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(done.output_ids)]
        return max(abs(g - w) for g, w in zip(done.output_logprobs, want, strict=True))

    assert err(windowed) < 0.1
    assert err(unwindowed) > 3 * err(windowed), (err(windowed), err(unwindowed))


@pytest.mark.parametrize("case", ["greedy", "seeded_filtered", "logprobs"])
def test_a_resumed_request_continues_exactly(engine, case):
    check_resumes(engine, CASES[case], exact_logprobs=True)


def test_the_same_bits_beside_any_batch(engine):
    check_same_bits_beside_others(engine)
