"""Prefill matmuls shared with a helper thread on a spare core (engine/kernels/spare_core.py,
engine/kernels/csrc/spare_core.cpp): the product has the same bits whoever computes which block and
is the fp32 matmul's within rounding (in bf16 on the blocked kernel: the unsplit product's bits),
the helper runs where it was put at the lowest priority, only prefill-sized products take it, and a
model served with it matches transformers token for token (in bf16: the engine without it)."""

from __future__ import annotations

import os
import random
import time

import httpx
import pytest
import torch
import torch.nn.functional as F
from cluster import NODE_ARGS, free_port, helper_threads, start
from reference import hf_greedy, load_hf

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.kernels import bf16_linear, cpu_kernels
from pdserve.engine.kernels import spare_core as sc
from pdserve.engine.kernels.switches import KernelSwitches
from pdserve.engine.model import linear as lin
from pdserve.runtime.node_ranks import spare_cores


@pytest.fixture(scope="module")
def spare():
    """The helper, on this host's last core (the same core on a 1-core host: still a second
    thread). Off again after the module, so later modules in this worker take the plain path."""
    assert cpu_kernels.load(), cpu_kernels.why_not()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a one-thread rank: the helper's own parallel regions too
    cores = (sorted(os.sched_getaffinity(0))[-1],)
    said = sc.start(cores, 1, torch.float32, blocked=0)
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
    assert sc.start((), 1, torch.float32, blocked=0) == ""
    assert "2 compute threads" in sc.start((1,), 2, torch.float32, blocked=0)
    assert "dtype" in sc.start((1,), 1, torch.float16, blocked=0)
    if not bf16_linear.available():  # bf16 takes it only on the blocked kernel
        assert "bf16 without the blocked kernel" in sc.start((1,), 1, torch.bfloat16, blocked=4)
    else:  # and only where the rank's matmuls have blocked copies
        assert "bf16 without blocked weights" in sc.start((1,), 1, torch.bfloat16, blocked=0)


blocked_kernel = pytest.mark.skipif(
    not bf16_linear.available(), reason="the blocked bf16 kernel is off on this CPU"
)


@blocked_kernel
@pytest.mark.parametrize("rows, cols", [(512, 160), (700, 100), (1031, 160)])
def test_bf16_products_on_the_blocked_kernel_have_the_unsplit_bits(spare, rows, cols):
    """The blocked kernel's rows do not depend on their neighbours: split between the threads,
    the product is the unsplit kernel's bit for bit, with and without a bias; until the helper has
    taken at least one block (bounded by 20 s)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(cols, 96, generator=g).bfloat16()
    bias = torch.randn(cols, generator=g).bfloat16()
    bw = bf16_linear.block(w)
    assert sc.takes_blocked(x) and not sc.takes_blocked(x[: sc.MIN_ROWS - 1])
    want = bf16_linear.linear(x, bw)
    want_bias = want.clone().add_(bias)
    before, deadline, calls = claimed(sc.counts()), time.monotonic() + 20, 0
    while calls < 20 or (claimed(sc.counts()) == before and time.monotonic() < deadline):
        assert torch.equal(sc.blocked_linear(x, bw, None), want)
        assert torch.equal(lin.linear(x, w, lin.SmallWeights(None, None, bw), bias), want_bias)
        calls += 1
    assert claimed(sc.counts()) > before, "the helper never took a block"
    with pytest.raises(RuntimeError, match="another shape"):  # refused before the helper sees it
        sc.blocked_linear(torch.randn(600, 64).bfloat16(), bw, None)


@blocked_kernel
def test_bf16_blocks_the_helper_computed_are_placed_with_the_unsplit_bits(spare):
    """A prefill-sized product (2048 rows, SmolLM2's gate/up shape): the helper finishes blocks
    before the rank reaches them, and those placed blocks give the unsplit product's bits; until
    it has finished at least one (bounded by 20 s)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 576, generator=g).bfloat16()
    bw = bf16_linear.block(torch.randn(3072, 576, generator=g).bfloat16())
    want = bf16_linear.linear(x, bw)
    before, deadline = sc.counts()["helper"], time.monotonic() + 20
    while sc.counts()["helper"] == before and time.monotonic() < deadline:
        assert torch.equal(sc.blocked_linear(x, bw, None), want)
    assert sc.counts()["helper"] > before, "the helper never finished a block"


def long_prompt_engine(model, dtype: str, cores, kernels=KernelSwitches()) -> Engine:
    """A one-thread engine whose forwards take up to 1024 prompt tokens, so that prompts of
    520-900 tokens make prefill-sized products."""
    cfg = EngineConfig(
        kernels=kernels,
        model=str(model),
        chunk_size=1024,
        max_batch_tokens=1024,
        max_total_tokens=4096,
        threads=1,
        dtype=dtype,
        spare_cores=cores,
        enable_prefix_cache=False,
    )
    return Engine(cfg)


def test_a_model_served_with_the_helper_matches_transformers(spare, tiny_model):
    """Prompts of 520-900 tokens in forwards of up to 1024: their matmuls take the helper."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (520, 700, 900)]
    eng = long_prompt_engine(tiny_model, "float32", spare)
    threads = torch.get_num_threads()
    try:
        before = sum(sc.counts().values())
        outs = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert sum(sc.counts().values()) > before
    finally:
        torch.set_num_threads(threads)
    assert [o.token_ids for o in outs] == hf_greedy(load_hf(tiny_model), prompts, 8)


def test_switched_off_an_engine_serves_without_the_helper(spare, tiny_model, kernel_switches):
    """An engine whose config has the helper switched off (`--no-kernel-spare-core`) offers it no
    product, though it is given the spare core and the helper runs, and serves transformers'
    tokens."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (520, 700)]
    threads = torch.get_num_threads()
    try:
        eng = long_prompt_engine(tiny_model, "float32", spare, KernelSwitches(spare_core=False))
        assert not sc.active()
        said = sc.start(spare, 1, torch.float32, blocked=0)
        assert said == "no prefill helper (switched off: --no-kernel-spare-core)"
        before = sc.counts()
        outs = eng.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
        assert sc.counts() == before
    finally:
        sc._cores = spare
        torch.set_num_threads(threads)
    assert [o.token_ids for o in outs] == hf_greedy(load_hf(tiny_model), prompts, 8)


@blocked_kernel
def test_a_bf16_model_served_with_the_helper_decodes_as_without_it(spare, tiny_model):
    """bf16 prompts of 520-900 tokens in forwards of up to 1024: their matmuls take the helper,
    and every sampled token is the one the engine without the helper samples."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 380) for _ in range(n)] for n in (520, 700, 900)]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=7)

    def tokens(cores):
        eng = long_prompt_engine(tiny_model, "bfloat16", cores)
        return [o.token_ids for o in eng.generate(prompts, params)]

    threads = torch.get_num_threads()
    try:
        before = sum(sc.counts().values())
        helped = tokens(spare)
        # the products went through the split (which blocks the helper finished of a tiny model's
        # products is up to timing: the tests above make it finish some)
        assert sum(sc.counts().values()) > before
        sc._cores = ()  # off: the same engine config without the helper
        after = sum(sc.counts().values())
        alone = tokens(())
        assert sum(sc.counts().values()) == after
    finally:
        sc._cores = spare
        torch.set_num_threads(threads)
    assert helped == alone


@blocked_kernel
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="no I/O core on one core")
def test_a_bf16_node_runs_its_helper_on_the_io_core(tiny6, tmp_path):
    """`pdserve serve --pp 1 --dtype bfloat16`: the rank tells the helper how many of its matmuls
    have blocked copies, and the helper runs on the plan's I/O core at nice 19 (the rank process
    once passed none, and its bf16 helper stayed off)."""
    port = free_port()
    node = ["serve", "--model", str(tiny6), "--pp", "1", "--dtype", "bfloat16"]
    with start([*node, "--port", str(port), *NODE_ARGS], port, tmp_path / "node.log") as (url, _):
        info = httpx.get(f"{url}/server_info", timeout=10).json()
        (rank,) = info["ranks"]
        assert helper_threads(rank["pid"], info["front_cpus"]) == 1
        log = (tmp_path / "node.log").read_text()
        assert "prefill matmuls shared with a helper on spare core" in log, log[-2000:]
