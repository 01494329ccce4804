"""The sampler's draws against the distributions they must follow (engine/sampling.py), on both of
its paths: the C++ op (engine/kernels/csrc/sampling.cpp) and the torch one.

Every draw comes from a seeded generator, so each count below is the same on every run: the bounds
(4.5 standard deviations of a binomial count) are for a correct sampler, and a sampler that
ignores the temperature, shifts a token or lets a filtered one through misses them by far more.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine import sampling
from pdserve.engine.core import SamplingParams
from pdserve.engine.sampling import sample


@pytest.fixture(autouse=True, params=["kernel", "torch"])
def path(request, kernel_switches):
    """The C++ op, or the torch path (`--no-kernel-sampling`)."""
    kernel_switches(sampling=request.param == "kernel")
    if request.param == "kernel":
        assert sampling.kernel_on(), sampling.why_kernel_off()
    else:
        assert sampling.why_kernel_off() == "switched off: --no-kernel-sampling"
    return request.param


def test_the_op_chooses_only_where_switched_on(path):
    """Greedy and temperature rows go through the C++ op on the kernel path and never with
    `--no-kernel-sampling`; greedy rows take the argmax either way."""
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams()] * 3 + [SamplingParams(temperature=0.8, seed=1)] * 3
    with torch.profiler.profile() as prof:
        out = sample(logits, params, [0] * 6, torch.Generator())
    assert ("pdserve::sample_rows" in {e.key for e in prof.key_averages()}) == (path == "kernel")
    assert list(out.token_ids[:3]) == logits[:3].argmax(-1).tolist()


# Tokens 0 and 5 (the first and the last) have probability 0: the inverse CDF's edges.
PROBS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.0]


def _counts(params: SamplingParams, n: int, seed: int = 0, probs=PROBS) -> list[float]:
    logits = torch.tensor(probs).log().expand(n, len(probs)).clone()
    g = torch.Generator()
    g.manual_seed(seed)
    out = sample(logits, [params] * n, [0] * n, g)
    return torch.bincount(torch.tensor(out.token_ids), minlength=len(probs)).tolist()


def _assert_follows(counts: list[int], weights: list[float]) -> None:
    n, total = sum(counts), sum(weights)
    for token, (c, w) in enumerate(zip(counts, weights, strict=True)):
        p = w / total
        if p == 0.0:
            assert c == 0, (token, counts)
        else:
            assert abs(c - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)), (token, counts, weights)


def test_temperature_draws_follow_softmax_of_logits_over_temperature():
    n = 40_000
    _assert_follows(_counts(SamplingParams(temperature=1.0), n), PROBS)
    # p^(1/T): T = 0.5 squares the probabilities, T = 2 takes their square root.
    _assert_follows(_counts(SamplingParams(temperature=0.5), n), [p**2 for p in PROBS])
    _assert_follows(_counts(SamplingParams(temperature=2.0), n), [p**0.5 for p in PROBS])


def test_filtered_draws_keep_only_what_the_filter_keeps():
    n = 6_000
    kept_3_4 = [0.0, 0.0, 0.0, 0.3, 0.4, 0.0]
    _assert_follows(_counts(SamplingParams(temperature=1.0, top_k=2), n), kept_3_4)
    # top_p 0.5: 0.4, then 0.3 (the mass before it, 0.4, is still under 0.5), then no more.
    _assert_follows(_counts(SamplingParams(temperature=1.0, top_p=0.5), n), kept_3_4)
    # min_p 0.6: at least 0.6 x 0.4 = 0.24.
    _assert_follows(_counts(SamplingParams(temperature=1.0, min_p=0.6), n), kept_3_4)


def test_a_large_vocabulary_and_one_likely_token_at_its_end():
    """SmolLM2's vocabulary size, the mass in one token at the last index and one in the middle:
    rounding in 49,152 cumulative sums must not move a draw off them."""
    vocab = 49_152
    probs = [0.0] * vocab
    probs[-1], probs[20_000] = 0.7, 0.3
    counts = _counts(SamplingParams(temperature=1.0), 2_000, probs=probs)
    _assert_follows([counts[20_000], counts[-1]], [0.3, 0.7])
    assert counts[20_000] + counts[-1] == 2_000


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch():
    vocab = 64
    torch.manual_seed(3)
    logits = torch.randn(5, vocab)
    seeded = SamplingParams(temperature=0.8, seed=1234)
    others = [
        SamplingParams(),  # greedy
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=5),
    ]
    for step in range(8):
        alone = sample(logits[2:3], [seeded], [step]).token_ids[0]
        g = torch.Generator()
        g.manual_seed(step)
        mixed = sample(logits, others[:2] + [seeded] + others[2:], [step] * 5, g).token_ids
        assert mixed[2] == alone
        assert mixed[0] == int(torch.argmax(logits[0]))


def test_a_row_with_every_token_masked_takes_the_argmax_and_spares_the_others():
    vocab = 6
    logits = torch.tensor(PROBS).log().expand(4_000, vocab).clone()
    logits[7] = float("-inf")  # no distribution: softmax gives NaN
    g = torch.Generator()
    g.manual_seed(0)
    out = sample(logits, [SamplingParams(temperature=1.0)] * 4_000, [0] * 4_000, g).token_ids
    assert out[7] == 0  # argmax of a row of equal values: its first token
    rest = out[:7] + out[8:]
    _assert_follows(torch.bincount(torch.tensor(rest), minlength=vocab).tolist(), PROBS)


def test_bf16_logits_choose_what_their_fp32_values_choose():
    """The forward leaves bf16 logits; the kernel reads them as they are, and a row's choice is the
    one its exact fp32 values give (the torch path converts first)."""
    torch.manual_seed(5)
    logits = (torch.randn(16, 1000) * 4).bfloat16()
    params = [SamplingParams(temperature=0.7, seed=s) for s in range(8)] + [SamplingParams()] * 8
    assert (
        sample(logits, params, [3] * 16).token_ids
        == sample(logits.float(), params, [3] * 16).token_ids
    )


def test_draws_are_the_exact_inverse_cdf_but_within_rounding_of_a_boundary(path):
    """Against the inverse CDF in float64 with the same uniform numbers: a token may differ only
    where u lies within 1e-6 of the boundary between two tokens (float32 weights round at about
    1e-7), and that is rare."""
    torch.manual_seed(9)
    n = 2_000
    logits = torch.randn(n, 500) * 2
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(n)]
    chosen = sample(logits, params, [0] * n).token_ids
    u = torch.tensor([sampling._uniform(p, 0, None) for p in params], dtype=torch.float64)
    cum = torch.cumsum(torch.softmax(logits.double() / 0.9, dim=-1), dim=-1)
    exact = torch.searchsorted(cum, u[:, None], right=True)[:, 0].tolist()
    differ = [i for i in range(n) if chosen[i] != exact[i]]
    for i in differ:
        edge = cum[i, min(chosen[i], exact[i])].item()  # the boundary between the two
        assert abs(chosen[i] - exact[i]) == 1 and abs(edge - u[i].item()) < 1e-6, (i, path)
    assert len(differ) <= 5, (len(differ), path)


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """top-p as the definition reads: the whole vocabulary sorted (ties by token id)."""
    sorted_p, idx = torch.sort(probs, descending=True, stable=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    sorted_p = sorted_p.masked_fill((cum - sorted_p) > top_p, 0.0)
    return torch.zeros_like(probs).scatter_(0, idx, sorted_p)


def _rows(vocab: int) -> list[torch.Tensor]:
    """Logit rows of every shape the candidates' floors meet: flat (the nucleus is most of the
    vocabulary: every floor falls short, the full sort serves), peaked (a few candidates), a
    Zipf-like language model's, and ties at the nucleus' edge."""
    g = torch.Generator().manual_seed(11)
    rank = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = [torch.randn(vocab, generator=g) * s for s in (0.3, 1.0, 3.0, 8.0)]
    rows.append((-1.1 * rank.log() * 3)[torch.randperm(vocab, generator=g)])
    tied = torch.full((vocab,), -5.0)
    tied[torch.randperm(vocab, generator=g)[:40]] = 2.0  # 40 equal tokens hold most of the mass
    rows.append(tied)
    return rows


@pytest.mark.parametrize("vocab", [49_152, 262_144])
def test_top_p_without_a_full_sort_is_the_full_sorts_value_for_value(vocab):
    """engine/sampling.py `_nucleus` sorts only the tokens above a floor: its filtered
    distribution equals the full sort's exactly, with min-p (its floor) and top-k before it."""
    cases = [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.999),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
        SamplingParams(temperature=1.0, min_p=0.05, top_p=0.9),
        SamplingParams(temperature=1.0, min_p=0.001, top_p=0.2),
    ]
    for row in _rows(vocab):
        for p in cases:
            got = sampling._filtered_probs(row, p)
            x = row / p.temperature
            if p.top_k > 0:
                x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
            probs = torch.softmax(x, dim=-1)
            if p.min_p > 0:
                probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            want = _nucleus_by_full_sort(probs, p.top_p)
            assert torch.equal(got, want / want.sum()), (vocab, p)


def test_top_p_at_an_ulp_of_the_candidates_mass_keeps_what_the_full_sort_keeps():
    """Two tokens whose float32 mass is float32(0.8), just above 0.8 as a double: the full sort
    keeps a third token (its preceding mass is not above float32(0.8)), so the candidates above
    the first floor must not be taken as the whole nucleus."""
    probs = torch.tensor([0.5, 0.3] + [0.0005] * 400)
    got = sampling._nucleus(probs, 0.8)
    assert torch.equal(got, _nucleus_by_full_sort(probs, 0.8))
    assert int((got > 0).sum()) == 3
