"""Sampling on the last slice: penalties and logit_bias, then greedy or temperature, top-k, top-p,
min-p, per-request seeds; logprobs.

Logits are adjusted first, in this order: logit_bias added; repetition penalty over the prompt and
generated tokens (a positive logit divided by it, a negative one multiplied, as transformers'
RepetitionPenaltyLogitsProcessor); frequency and presence penalties over the generated tokens
(logit -= frequency * count + presence * [count > 0], as OpenAI and vLLM define them). Greedy
requests take the argmax of the adjusted logits; logprobs are those of the adjusted logits.

A seeded request draws from a generator seeded by (seed, number of tokens it already generated), so
its output depends only on its own logits and seed, never on what else shares its batch. Unseeded
requests draw from the node's generator. Sampling runs on the last PP rank only; the chosen tokens
then travel the output ring, so no other rank ever draws a random number.
"""

from __future__ import annotations

import torch

from engine.batch import SampleOut
from engine.core import SamplingParams

_MIX = 0x9E3779B97F4A7C15


def _seeded_generator(seed: int, step: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * _MIX) & ((1 << 63) - 1))
    return g


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities of one row after temperature, top-k, top-p and min-p."""
    x = logits / p.temperature
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return probs / probs.sum()


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
    """logits: float32 [R, vocab], one row per sampling request; steps[i] = tokens it generated so
    far; histories[i] = (prompt ids, generated ids), needed only for penalized requests; `mask`
    forbids tokens in place after the penalties (structured output, engine/grammar.py)."""
    logits = logits.float()
    if mask is not None or any(p.penalized for p in params):
        logits = logits.clone()  # the forward's output is an inference tensor: adjust a copy
    for i, p in enumerate(params):
        if p.penalized:
            apply_penalties(logits[i], p, *histories[i])
    if mask is not None:
        mask(logits)
    if mask is not None or any(p.penalized for p in params):
        # An extreme repetition penalty can overflow a logit; NaN must never reach a choice.
        logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max)
    tokens = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = _filtered_probs(logits[i], p)
        if not bool(torch.isfinite(probs).all()) or not float(probs.sum()) > 0.0:
            continue  # a degenerate distribution (overflow, every token masked): the argmax
        g = _seeded_generator(p.seed, steps[i]) if p.seed is not None else generator
        tokens[i] = torch.multinomial(probs, 1, generator=g)[0]
    token_ids = tokens.tolist()
    want_lp = any(p.logprobs for p in params)
    if not want_lp:
        return SampleOut(token_ids)
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(p.top_logprobs for p in params)
    tops: list[list[tuple[int, float]]] = [[] for _ in params]
    if k > 0:
        vals, idx = torch.topk(logp, k, dim=-1)
        vals, idx = vals.tolist(), idx.tolist()
        tops = [
            list(zip(idx[i][: p.top_logprobs], vals[i][: p.top_logprobs], strict=True))
            for i, p in enumerate(params)
        ]
    return SampleOut(token_ids, chosen, tops)
