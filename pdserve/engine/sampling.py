"""Sampling on the last slice: penalties and logit_bias, then greedy or temperature, top-k, top-p,
min-p, per-request seeds; logprobs.

Logits are adjusted first, in this order: logit_bias added; repetition penalty over the prompt and
generated tokens (a positive logit divided by it, a negative one multiplied, as transformers'
RepetitionPenaltyLogitsProcessor); frequency and presence penalties over the generated tokens
(logit -= frequency * count + presence * [count > 0], as OpenAI and vLLM define them). Greedy
requests take the argmax of the adjusted logits; logprobs are those of the adjusted logits.

A sampled row draws its token by the inverse of its distribution's CDF: one uniform number u, the
row's cumulative sums, and a binary search for the first token whose cumulative sum passes u times
the total. That is exact categorical sampling for one uniform draw per row, and the rows without a
top-k, top-p or min-p filter (an OpenAI client's defaults) are computed together. torch.multinomial
draws one exponential number per vocabulary entry instead (the exponential race), which cost a
decode step of 32 requests a large share of its time (bench/bench_sampling.py measures both;
bench/results/sampling.md).

On the CPU, the greedy and unfiltered rows are chosen by one C++ op
(engine/kernels/csrc/sampling.cpp): each row read once, straight from the forward's bf16 or fp32
logits. It is off with `--no-kernel-sampling`, and where the kernels cannot be built; the torch
path (also CUDA's) then does the same arithmetic in five passes. The two may round a weight
differently, so a draw at the very edge of two tokens can differ between them, never between two
runs of one.

A seeded request draws u from a generator seeded by (seed, number of tokens it already generated),
so its output depends only on its own logits and seed, never on what else shares its batch.
Unseeded requests draw from the node's generator, in row order. Sampling runs on the last PP rank
only; the chosen tokens then travel the output ring, so no other rank ever draws a random number.
"""

from __future__ import annotations

import torch

from pdserve.engine.batch import SampleOut
from pdserve.engine.core import SamplingParams
from pdserve.engine.kernels import cpu_kernels, switches

_MIX = 0x9E3779B97F4A7C15
_kernel_on: bool | None = None  # decided at the first batch, again after the switches change


def kernel_on() -> bool:
    """Whether the C++ op chooses the greedy and unfiltered rows in this process (once per set of
    switches; never raises)."""
    global _kernel_on
    if _kernel_on is None:
        _kernel_on = switches.current().sampling and cpu_kernels.load()
    return _kernel_on


def why_kernel_off() -> str:
    """Why the C++ op is off in this process, or "" where it is on."""
    if kernel_on():
        return ""
    return switches.why_off("sampling") or cpu_kernels.why_not()


@switches.on_change
def _forget() -> None:
    global _kernel_on
    _kernel_on = None


def _seeded_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * _MIX) & ((1 << 63) - 1))
    return g


def _unfiltered(p: SamplingParams, vocab: int) -> bool:
    """Whether a sampled row is temperature alone: no top-k, top-p or min-p filter."""
    return not 0 < p.top_k < vocab and p.top_p >= 1.0 and p.min_p <= 0.0


def _uniform(p: SamplingParams, step: int, generator: torch.Generator | None) -> float:
    g = _seeded_generator(p.seed, step) if p.seed is not None else generator
    return float(torch.rand((), generator=g, dtype=torch.float64))


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token per row, whether the row had a distribution) for float32 weights [K, V] >= 0, in
    proportion to the probabilities, and uniform draws u [K] in [0, 1). The first token whose
    cumulative weight passes u * total: a token of weight 0 is never it, since its cumulative
    weight equals the one before it; the target is kept below the total, so rounding never walks
    past the last token of positive weight. A row of total 0 or NaN (every token masked, an
    overflow) has no distribution."""
    cum = torch.cumsum(weights, dim=-1)
    total = cum[:, -1]
    ok = torch.isfinite(total) & (total > 0)
    total = torch.where(ok, total, torch.ones_like(total))
    target = torch.minimum(
        u.to(total.dtype) * total, torch.nextafter(total, torch.zeros_like(total))
    )
    tokens = torch.searchsorted(cum, target[:, None], right=True)[:, 0]
    return tokens.clamp_(max=weights.shape[-1] - 1), ok


# Probability floors tried for top-p's candidates, largest first (then every token).
NUCLEUS_FLOORS = (1e-3, 1e-5, 1e-7)
NUCLEUS_MARGIN = 1e-5


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities of one row after temperature, top-k, top-p and min-p."""
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    zero_below = 0.0
    if p.min_p > 0.0:
        zero_below = float(p.min_p * probs.max())
        probs = probs.masked_fill(probs < zero_below, 0.0)
    if p.top_p < 1.0:
        probs = _nucleus(probs, p.top_p, zero_below)
    return probs / probs.sum()


def _nucleus(probs: torch.Tensor, top_p: float, zero_below: float = 0.0) -> torch.Tensor:
    """`probs` with the tokens after the smallest most-likely prefix whose mass reaches top_p set
    to 0 (a token stays where the mass of the tokens before it is at most top_p); `zero_below`:
    every token below it is 0 already (min-p).

    Without sorting the whole vocabulary (262k entries for Gemma 3; bench/results/sampling.md):
    the candidates are the tokens of probability >= a floor, sorted alone. Every other token is
    less likely than each candidate, so it comes after all of them in the full sort, and it is
    dropped there where the candidates' mass passes top_p; below `zero_below` it is 0 anyway.
    So the result is the full sort's, value for value. A floor whose candidates fall short of
    top_p gives way to the next; the last, 0, is every token."""
    floors = (zero_below,) if zero_below > 0.0 else NUCLEUS_FLOORS
    for floor in (*floors, 0.0):
        idx = (probs >= floor).nonzero()[:, 0] if floor > 0.0 else None
        cand = probs if idx is None else probs.index_select(0, idx)
        # a margin over top_p: the full sort compares float32 prefix sums with top_p in float32,
        # which may keep one token more where the candidates' mass is within an ulp of it
        if idx is not None and not zero_below and float(cand.sum()) <= top_p + NUCLEUS_MARGIN:
            continue
        sorted_p, order = torch.sort(cand, descending=True, stable=True)  # ties: by token id
        cum = torch.cumsum(sorted_p, dim=-1)
        sorted_p = sorted_p.masked_fill((cum - sorted_p) > top_p, 0.0)
        where = order if idx is None else idx.index_select(0, order)
        return torch.zeros_like(probs).index_copy_(0, where, sorted_p)
    raise AssertionError("the last floor, 0, takes every token")


def apply_penalties(
    row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> None:
    """Adjusts one row of logits in place (see the module docstring for the order)."""
    vocab = row.numel()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=row.dtype)
        row.index_add_(0, ids, bias)
    if p.repetition_penalty != 1.0 and (prompt or output):
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        x = row.index_select(0, seen)
        row.index_copy_(
            0, seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        )
    if (p.frequency_penalty or p.presence_penalty) and output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab]
        row.sub_(p.frequency_penalty * counts + p.presence_penalty * (counts > 0))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    steps: list[int],
    generator: torch.Generator | None = None,
    histories: list[tuple[list[int], list[int]]] | None = None,
    mask=None,
) -> SampleOut:
    """logits: [R, vocab] (fp32, or bf16 as the forward leaves them), one row per sampling
    request; steps[i] = tokens it generated so far; histories[i] = (prompt ids, generated ids),
    needed only for penalized requests; `mask` forbids tokens in place after the penalties
    (structured output, engine/grammar.py)."""
    logits = _adjusted(logits, params, histories, mask)
    vocab = logits.shape[-1]
    # One uniform number per sampled row, in row order, whichever path chooses its token.
    u = [0.0 if p.greedy else _uniform(p, steps[i], generator) for i, p in enumerate(params)]
    filtered = [i for i, p in enumerate(params) if not p.greedy and not _unfiltered(p, vocab)]
    if logits.device.type == "cpu" and logits.stride(-1) == 1 and kernel_on():
        # Filtered rows are the torch path's: the kernel only takes their (cheap) argmax.
        skip = set(filtered)
        temps = torch.tensor(
            [0.0 if p.greedy or i in skip else p.temperature for i, p in enumerate(params)]
        )
        tokens = torch.ops.pdserve.sample_rows(logits, temps, torch.tensor(u, dtype=torch.float64))
        rest = filtered
    else:
        tokens = torch.full((len(params),), -1, dtype=torch.long)
        rest = [i for i, p in enumerate(params) if not p.greedy]
    if rest:
        rows32 = logits.index_select(0, torch.tensor(rest)).float()
        plain = [k for k, i in enumerate(rest) if _unfiltered(params[i], vocab)]
        weights = torch.empty(len(rest), vocab)
        if plain:  # together: softmax of logits / temperature
            temps = torch.tensor([params[rest[k]].temperature for k in plain])
            weights[plain] = torch.softmax(rows32[plain] / temps[:, None], dim=-1)
        for k in sorted(set(range(len(rest))) - set(plain)):
            weights[k] = _filtered_probs(rows32[k], params[rest[k]])
        picks, ok = _inverse_cdf(weights, torch.tensor([u[i] for i in rest]))
        tokens[rest] = torch.where(ok, picks, -1)
    # The argmax for greedy rows the kernel did not choose, and for rows without a distribution
    # (an overflow, every token masked).
    argmaxed = (tokens < 0).nonzero()[:, 0]
    if len(argmaxed) == len(params):
        tokens = torch.argmax(logits.float(), dim=-1)
    elif len(argmaxed):
        tokens[argmaxed] = torch.argmax(logits.index_select(0, argmaxed).float(), dim=-1)
    token_ids = tokens.tolist()
    if not any(p.logprobs for p in params):
        return SampleOut(token_ids)
    return _with_logprobs(logits, params, tokens, token_ids)


def _adjusted(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[tuple[list[int], list[int]]] | None,
    mask,
) -> torch.Tensor:
    """`logits` after the penalties and the mask, as a fp32 copy; `logits` itself where no row
    is adjusted."""
    adjusted = mask is not None or any(p.penalized for p in params)
    if adjusted:
        logits = logits.float().clone()  # the forward's output is an inference tensor: a copy
    for i, p in enumerate(params):
        if p.penalized:
            assert histories is not None  # callers pass them whenever a request is penalized
            apply_penalties(logits[i], p, *histories[i])
    if mask is not None:
        mask(logits)
    if adjusted:
        # An extreme repetition penalty can overflow a logit; NaN must never reach a choice.
        logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    return logits


def _with_logprobs(
    logits: torch.Tensor, params: list[SamplingParams], tokens: torch.Tensor, token_ids: list[int]
) -> SampleOut:
    """The chosen tokens' logprobs and each row's top alternatives, after every adjustment."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(p.top_logprobs for p in params)
    tops: list[list[tuple[int, float]]] = [[] for _ in params]
    if k > 0:
        top_vals, top_idx = torch.topk(logp, k, dim=-1)
        vals, idx = top_vals.tolist(), top_idx.tolist()
        tops = [
            list(zip(idx[i][: p.top_logprobs], vals[i][: p.top_logprobs], strict=True))
            for i, p in enumerate(params)
        ]
    return SampleOut(token_ids, chosen, tops)
