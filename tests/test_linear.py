"""Small-batch weights (engine/model/linear.py): the reordered copy gives the plain matmul's result,
it is used exactly for the rows `reordered_rows` names (fp32: SMALL_MIN..SMALL_MAX; bf16: all), and
a model that has it still matches transformers."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.model import linear as lin
from pdserve.engine.model.loader import load_model_config, load_slice
from tests.test_model import PLAN, TOTAL, hf_logits, max_err, run_plan
from tests.tiny_model import build_tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reordered_equals_plain(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 96, generator=g).to(dtype)
    bias = torch.randn(200, generator=g).to(dtype)
    small = lin.SmallWeights(reordered=lin.reorder(w))
    assert small.reordered is not None  # this CPU build of torch has oneDNN
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    for m in (1, 2, 3, 4, 8, 31, 128, 129, 300):
        x = torch.randn(m, 96, generator=g).to(dtype)
        ref = F.linear(x.float(), w.float(), bias.float())
        got = lin.linear(x, w, small, bias)
        assert got.dtype == dtype and got.shape == (m, 200)
        torch.testing.assert_close(got.float(), ref, **tol)
        h = torch.randn(m, 200, generator=g).to(dtype)
        want = h.float() + F.linear(x.float(), w.float())
        lin.add_linear_(h, x, w, small)
        torch.testing.assert_close(h.float(), want, **tol)


def _spy_on_the_reordered_path(monkeypatch) -> list[int]:
    """The row counts of the products that go through the reordered copy (the real op runs)."""
    calls = []
    real = lin._onednn_linear

    def counted(x, s, bias):
        calls.append(x.shape[0])
        return real(x, s, bias)

    monkeypatch.setattr(lin, "_onednn_linear", counted)
    return calls


def test_the_small_path_is_taken_for_small_batches_only(monkeypatch):
    w = torch.randn(64, 32)
    small = lin.small_batch_weights(w)  # random fp32: no grid, so only the reordered copy
    assert small.packed is None and small.reordered is not None
    calls = _spy_on_the_reordered_path(monkeypatch)
    for m in range(1, lin.SMALL_MAX + 20):
        lin.linear(torch.randn(m, 32), w, small)
        lin.add_linear_(torch.zeros(m, 64), torch.randn(m, 32), w, small)
    assert calls == [m for m in range(lin.SMALL_MIN, lin.SMALL_MAX + 1) for _ in range(2)]
    calls.clear()
    for m in (1, 4):
        lin.linear(torch.randn(m, 32), w, None)  # no copy: always plain
    assert calls == []


def test_bf16_batches_of_every_size_take_the_reordered_copy(monkeypatch, kernel_switches):
    """In bf16 the reordered copy was faster at every row count measured (1 to 2048 on an AMX
    core, bench/results/linear_bf16.md); fp32 keeps SMALL_MIN..SMALL_MAX (above). Where the
    blocked bf16 kernel serves (AVX-512 BF16 without AMX, tests/test_bf16_linear.py), it takes
    the reordered copy's place: switched off here."""
    kernel_switches(bf16_linear=False)
    w = torch.randn(64, 32).to(torch.bfloat16)
    small = lin.small_batch_weights(w)
    assert small.packed is None and small.reordered is not None
    calls = _spy_on_the_reordered_path(monkeypatch)
    rows = [1, 2, 3, lin.SMALL_MAX, lin.SMALL_MAX + 1, 700]
    for m in rows:
        x = torch.randn(m, 32).to(torch.bfloat16)
        got = lin.linear(x, w, small)
        torch.testing.assert_close(got.float(), F.linear(x, w).float(), atol=0.05, rtol=0.02)
    assert calls == rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("llama"), tie=True)
    cfg = load_model_config(path)
    rng = random.Random(1)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    return path, cfg, seqs, hf_logits(path, seqs)


def test_a_model_with_small_batch_weights_matches_transformers(tiny, monkeypatch):
    path, cfg, seqs, ref = tiny
    slices = [load_slice(path, 0, 2), load_slice(path, 2, 4)]
    plain = run_plan(slices, cfg, seqs, PLAN)
    for s in slices:
        s.add_small_batch_weights()
    small = [v for s in slices for layer in s.layers for v in layer.small.values()]
    assert small and all(v.reordered is not None and v.packed is None for v in small)
    assert slices[-1]._small_head.reordered is not None
    calls = _spy_on_the_reordered_path(monkeypatch)
    got = run_plan(slices, cfg, seqs, PLAN)
    assert max_err(got, ref) < 1e-4
    assert got.keys() == plain.keys()
    for k in got:
        torch.testing.assert_close(got[k], plain[k], rtol=1e-4, atol=1e-4)
    # the model's products of SMALL_MIN..SMALL_MAX rows went through the reordered copy. (Whether
    # that changes the last bits depends on the CPU's oneDNN kernels: on one CI host it did not.)
    assert calls and all(lin.SMALL_MIN <= m <= lin.SMALL_MAX for m in calls)
