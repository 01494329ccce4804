"""Prefill matmuls shared with a helper thread on a spare core (engine/spare_core.py,
engine/csrc/spare_core.cpp): the product has the same bits whoever computes which block and is the
fp32 matmul's within rounding, the helper runs where it was put at the lowest priority, only
prefill-sized fp32 products take it, and a model served with it matches transformers token for
token."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.nn.functional as F
from cluster import helper_threads
from reference import hf_greedy, load_hf

from engine import cpu_kernels
from engine import linear as lin
from engine import spare_core as sc
from engine.config import EngineConfig
from engine.core import SamplingParams
from engine.engine import Engine
from runtime.serve import spare_cores


@pytest.fixture(scope="module")
def spare():
    """The helper, on this host's last core (the same core on a 1-core host: still a second
    thread). Off again after the module, so later modules in this worker take the plain path."""
    assert cpu_kernels.load(), cpu_kernels.why_not()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a one-thread rank: the helper's own parallel regions too
    cores = (sorted(os.sched_getaffinity(0))[-1],)
    said = sc.start(cores, 1, torch.float32)
    assert said.startswith("prefill matmuls shared with a helper on spare core"), said
    yield cores
    sc._cores = ()
    torch.set_num_threads(threads)


def blockwise(x, w, bias=None):
    """The product block by block, as both threads compute each block."""
    m, n = x.shape[0], sc.blocks(x.shape[0])
    starts = [m * b // n for b in range(n + 1)]
    out = [torch.mm(x[a:b], w.t()) for a, b in zip(starts, starts[1:], strict=False)]
    out = [o if bias is None else o.add_(bias) for o in out]
    return torch.cat(out)


def claimed(counts) -> int:
    return counts["helper"] + counts["taken_back"]


@pytest.mark.parametrize("rows, cols", [(512, 160), (700, 100), (1031, 160)])
def test_the_same_bits_whoever_computes_which_block(spare, rows, cols):
    """Repeated products are bit-identical to the block-by-block reference while the helper takes
    different blocks from call to call; until it has taken at least one (bounded by 20 s)."""
    g = torch.Generator().manual_seed(rows)
    # cols 100: the rank's thread writes rows of y that start off a 64-byte line, the helper not
    x, w = torch.randn(rows, 96, generator=g), torch.randn(cols, 96, generator=g)
    bias, h0 = torch.randn(cols, generator=g), torch.randn(rows, cols, generator=g)
    want, want_bias = blockwise(x, w), blockwise(x, w, bias)
    before, deadline, calls = claimed(sc.counts()), time.monotonic() + 20, 0
    while calls < 20 or (claimed(sc.counts()) == before and time.monotonic() < deadline):
        assert torch.equal(sc.linear(x, w, None), want)
        assert torch.equal(sc.linear(x, w, bias), want_bias)
        h = h0.clone()
        sc.add_linear_(h, x, w)
        assert torch.equal(h, h0 + want)
        calls += 1
    assert claimed(sc.counts()) > before, "the helper never took a block"
    torch.testing.assert_close(sc.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_the_helper_runs_on_the_spare_core_at_the_lowest_priority(spare):
    assert helper_threads(os.getpid(), spare) == 1


def test_only_prefill_sized_fp32_products_take_it(spare, monkeypatch):
    calls = []
    monkeypatch.setattr(sc, "linear", lambda x, w, b: calls.append(x.shape[0]) or F.linear(x, w, b))
    w = torch.randn(64, 32)
    for rows in (1, 200, 511, 512, 2048):
        lin.linear(torch.randn(rows, 32), w, None)
    lin.linear(torch.randn(600, 32, dtype=torch.bfloat16), w.bfloat16(), None)
    lin.linear(torch.randn(32, 600).t(), w, None)  # not contiguous
    assert calls == [512, 2048]


def test_spare_cores_are_the_io_cores_of_one_thread_ranks():
    assert spare_cores((1,), 1) == [1]
    assert spare_cores((3, 2), 1) == [2, 3]
    assert spare_cores((3,), 2) == []  # OpenMP ranks: no helper
    assert spare_cores((), 1) == []  # no I/O core: never another rank's core
    assert sc.start((), 1, torch.float32) == ""
    assert "2 compute threads" in sc.start((1,), 2, torch.float32)
    assert "dtype" in sc.start((1,), 1, torch.bfloat16)


def test_a_model_served_with_the_helper_matches_transformers(spare, tiny_model):
    """Prompts of 520-900 tokens in forwards of up to 1024: their matmuls take the helper."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (520, 700, 900)]
    eng = Engine(
        EngineConfig(
            model=str(tiny_model),
            chunk_size=1024,
            max_batch_tokens=1024,
            max_total_tokens=4096,
            threads=1,
            dtype="float32",
            spare_cores=spare,
        )
    )
    threads = torch.get_num_threads()
    try:
        before = sum(sc.counts().values())
        outs = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert sum(sc.counts().values()) > before
    finally:
        torch.set_num_threads(threads)
    assert [o.token_ids for o in outs] == hf_greedy(load_hf(tiny_model), prompts, 8)
