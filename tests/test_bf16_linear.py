"""The blocked bf16 matmul (engine/kernels/csrc/bf16_linear.cpp): on a CPU with AVX-512 BF16,
against fp32 products of the same bf16 inputs and against oneDNN's bf16 matmul, its bounds, and the
model's use of it. Without AMX it serves bf16 matmuls by default; with AMX (where oneDNN's copy
serves by default) it serves batch-invariant slices only, and the tests take it that way. Without
AVX-512 BF16 the kernel is off and these tests skip."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import bf16_linear, cpu_kernels
from pdserve.engine.model.linear import linear, small_batch_weights
from pdserve.engine.model.loader import load_model_config, load_slice
from tests.test_model import PLAN, TOTAL, hf_logits, max_err, run_plan
from tests.tiny_model import build_tiny_model

# With AMX the blocked kernel is reached through batch-invariant serving only
INVARIANT = "amx_bf16" in cpu_kernels.cpu_flags().split()


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_kernels.load(), cpu_kernels.why_not()
    why = bf16_linear.why_not(batch_invariant=True)
    if "AVX-512 BF16" in why:
        pytest.skip(f"the blocked bf16 kernel is off on this CPU: {why}")
    assert not why, why


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,k", [(32, 64), (100, 64), (576, 576), (960, 576), (576, 1536)])
def test_matches_fp32_products_and_onednn(n, k, threads):
    """Rows 1..13 (every tile height, one tail), 200 and 400 (past a chunk of 192 rows); column
    counts that are not a multiple of 32. Each output is the fp32 sum of exact bf16 products
    rounded once: within half a bf16 ulp of the exact product plus the fp32 sums' error, and equal
    to oneDNN's bf16 matmul but where the two orders of sums round apart (under 1 % of outputs)."""
    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    bw = bf16_linear.block(w, INVARIANT)
    assert bw is not None and bw.blocks.shape == (-(-n // 32), k // 2, 32, 2)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for m in [*range(1, 14), 200, 400]:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            got = bf16_linear.linear(x, bw)
            assert got.dtype == torch.bfloat16 and got.shape == (m, n)
            exact = x.double() @ w.double().t()
            err = (got.double() - exact).abs()
            # one rounding to bf16 (2^-9 relative) plus fp32 sums of k products
            bound = exact.abs() * 2.0**-8 + (x.double().abs() @ w.double().abs().t()) * k * 2.0**-23
            assert (err <= bound).all(), (m, (err - bound).max().item())
            ref = F.linear(x, w)  # oneDNN: the same products, its own order of sums
            assert ((got.double() - ref.double()).abs() <= 2 * bound).all(), m
            assert (got != ref).float().mean() < 0.01, (m, (got != ref).float().mean())
    finally:
        torch.set_num_threads(old)


def test_rows_with_a_stride_and_every_row_count_of_a_decode_step():
    """x as columns of a wider tensor (a slice of a fused projection's output) gives the rows a
    contiguous copy gives, bit for bit; so does every row count from 1 to 64."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(960, 576, generator=g).to(torch.bfloat16)
    bw = bf16_linear.block(w, INVARIANT)
    wide = torch.randn(70, 1000, generator=g).to(torch.bfloat16)
    x = wide[:, 100:676]
    assert x.stride(0) == 1000
    assert torch.equal(bf16_linear.linear(x, bw), bf16_linear.linear(x.contiguous(), bw))
    full = bf16_linear.linear(x.contiguous(), bw)
    for m in range(1, 65):  # a row's output does not depend on the other rows of its tile
        assert torch.equal(bf16_linear.linear(x[:m].contiguous(), bw), full[:m]), m


def test_bad_shapes_are_refused():
    w = torch.randn(64, 63).to(torch.bfloat16)
    assert bf16_linear.block(w, INVARIANT) is None  # odd K: oneDNN's copy serves it
    assert bf16_linear.block(w.float(), INVARIANT) is None
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.pdserve.pack_bf16_linear(w)
    bw = bf16_linear.block(torch.randn(64, 64).to(torch.bfloat16), INVARIANT)
    with pytest.raises(RuntimeError, match="columns"):
        bf16_linear.linear(torch.randn(2, 32).to(torch.bfloat16), bw)
    with pytest.raises(RuntimeError, match="blocks"):
        torch.ops.pdserve.bf16_linear(torch.randn(2, 64).to(torch.bfloat16), bw.blocks, 65)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.pdserve.bf16_linear(torch.randn(2, 64), bw.blocks, 64)


def test_small_batch_weights_take_it_in_place_of_the_reordered_copy(monkeypatch, kernel_switches):
    w = torch.randn(96, 64).to(torch.bfloat16)
    small = small_batch_weights(w, batch_invariant=INVARIANT)
    assert small.blocked is not None and small.reordered is None  # one copy, not two
    x = torch.randn(5, 64).to(torch.bfloat16)
    bias = torch.randn(96).to(torch.bfloat16)
    assert torch.equal(linear(x, w, small, bias), bf16_linear.linear(x, small.blocked).add_(bias))
    # fp32 keeps its own paths
    assert small_batch_weights(w.float(), batch_invariant=INVARIANT).blocked is None
    kernel_switches(bf16_linear=False)
    assert bf16_linear.why_not() == "switched off: --no-kernel-bf16-linear"
    off = small_batch_weights(w)
    assert off.blocked is None and off.reordered is not None
    assert small_batch_weights(w, batch_invariant=True).blocked is None
    kernel_switches(bf16_linear=True)
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: "flags : avx512_bf16 amx_bf16 amx_tile")
    assert "AMX" in bf16_linear.why_not() and small_batch_weights(w).blocked is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("blocked"), hidden=96, heads=3, kv_heads=1)
    cfg = load_model_config(path)
    rng = random.Random(2)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    return path, cfg, seqs, hf_logits(path, seqs)


def test_the_model_runs_its_bf16_matmuls_through_it(tiny, monkeypatch, kernel_switches):
    """A bf16 slice with its matmul copies multiplies through the blocked kernel (counted: every
    layer matmul and the LM head of every forward) and agrees with transformers in fp32 as closely
    as the same slice on oneDNN's copies."""
    path, cfg, seqs, ref = tiny
    calls = []
    real = bf16_linear.linear

    def counted(x, bw):
        calls.append(x.shape[0])
        return real(x, bw)

    monkeypatch.setattr(bf16_linear, "linear", counted)
    s = load_slice(path, 0, 4, dtype=torch.bfloat16)
    assert "blocked bf16 weights with prefetch" in s.add_small_batch_weights(
        batch_invariant=INVARIANT
    )
    got = run_plan([s], cfg, seqs, PLAN, dtype=torch.bfloat16)
    assert len(calls) == len(PLAN) * (4 * cfg.num_layers + 1)
    kernel_switches(bf16_linear=False)
    onednn = load_slice(path, 0, 4, dtype=torch.bfloat16)
    assert "oneDNN-reordered" in onednn.add_small_batch_weights()
    calls.clear()
    base = run_plan([onednn], cfg, seqs, PLAN, dtype=torch.bfloat16)
    assert calls == []
    assert max_err(got, ref) < 0.1
    assert max_err(got, ref) < 1.5 * max_err(base, ref)
