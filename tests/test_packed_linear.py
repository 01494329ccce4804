"""Packed block-code weights (engine/kernels/packed_linear.py,
engine/kernels/csrc/packed_linear.cpp): a weight is packed only when its codes give back every value
bit for bit, the kernel's product equals the fp32 matmul's, decode-sized batches take it, and a
model with GGUF-grid weights still matches transformers and serves the same greedy tokens as without
it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file, save_file

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.kernels import bf16_linear, switches
from pdserve.engine.kernels import packed_linear as pl
from pdserve.engine.kernels.switches import KernelSwitches
from pdserve.engine.model import linear as lin
from pdserve.engine.model.loader import load_model_config, load_slice
from tests.test_model import PLAN, TOTAL, hf_logits, max_err, run_plan
from tests.tiny_model import build_tiny_model


@pytest.fixture(autouse=True, scope="module")
def kernels():
    assert pl.available(), pl.why_not()


def gguf_grid(w: np.ndarray, qtype: Q) -> np.ndarray:
    """`w` quantized and dequantized by the gguf package (llama.cpp's reference code): what a
    quantized GGUF's loader hands the model."""
    return dequantize(quantize(np.ascontiguousarray(w, np.float32), qtype), qtype).reshape(w.shape)


def decode(p: pl.PackedWeight) -> torch.Tensor:
    """The weights [out, in] the codes stand for, decoded here without the kernel."""
    if p.bits == 4:  # [panels, in / 2, 16]: columns k and k + 1 in the low and high nibbles
        q = torch.stack([p.codes & 15, p.codes >> 4], dim=2).flatten(1, 2).float()
    else:
        q = p.codes.float()  # [panels, in, 16]

    def per_column(t):  # [panels, in / 32, 16] -> [panels, in, 16]
        return t.repeat_interleave(32, dim=1)

    w = q * per_column(p.scale) + (per_column(p.offset) if p.bits == 4 else 0)
    return w.transpose(1, 2).reshape(-1, q.shape[1])


@pytest.mark.parametrize(("qtype", "bits"), [(Q.Q4_1, 4), (Q.Q8_0, 8)])
def test_the_codes_give_back_every_weight_bit_for_bit(qtype, bits):
    rng = np.random.default_rng(0)
    w = torch.from_numpy(gguf_grid(rng.standard_normal((96, 160)) * 0.05, qtype))
    w[5] = 0.0  # a block of one value (scale 0)
    p = pl.pack(w)
    assert p is not None and p.bits == bits
    assert torch.equal(decode(p), w)
    assert p.nbytes * 8 <= w.numel() * (bits + 2)  # codes plus fp32 scale (and offset) per 32


def test_what_is_not_a_grid_is_left_alone():
    rng = np.random.default_rng(1)
    plain = torch.from_numpy(rng.standard_normal((64, 64)).astype(np.float32))
    assert pl.pack(plain) is None
    grid = torch.from_numpy(gguf_grid(plain.numpy(), Q.Q4_1))
    assert pl.pack(grid) is not None
    off = grid.clone()
    off[3, 7] = torch.nextafter(off[3, 7], torch.tensor(1.0))  # one value one ulp off the grid
    assert pl.pack(off) is None
    assert pl.pack(grid[:, :48].contiguous()) is None  # rows not whole blocks
    assert pl.pack(grid[:56]) is None  # rows not a multiple of the kernel's panel
    assert pl.pack(grid.bfloat16()) is None


@pytest.mark.parametrize(("qtype", "bias"), [(Q.Q4_1, True), (Q.Q4_1, False), (Q.Q8_0, False)])
def test_the_packed_product_is_the_fp32_product(qtype, bias):
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(2)
    w = torch.from_numpy(gguf_grid(rng.standard_normal((208, 96)) * 0.05, qtype))
    b = torch.randn(208, generator=g) if bias else None
    small = lin.SmallWeights(packed=lin.small_batch_weights(w).packed)  # the packed copy alone
    assert isinstance(small.packed, pl.PackedWeight)
    for m in (1, 2, 3, 4, 5, 8, 31, lin.PACKED_MAX):  # every remainder of the kernel's row tiles
        x = torch.randn(m, 96, generator=g)
        ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
        got = lin.linear(x, w, small, b)
        assert got.shape == (m, 208)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        h = torch.randn(m, 208, generator=g)
        want = h + F.linear(x.double(), w.double()).float()
        lin.add_linear_(h, x, w, small)
        torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_a_bf16_weight_packs_from_its_fp32_source(qtype, kernel_switches):
    """A bf16 weight's codes come from the fp32 weight it was rounded from, only when that rounds
    to it exactly; the product multiplies by the bf16 weight's own values (exact products, fp32
    sums, one rounding to bf16), for every remainder of the row tiles."""
    kernel_switches(packed_bf16=True)
    g = torch.Generator().manual_seed(1)
    w = torch.from_numpy(
        gguf_grid(np.random.default_rng(5).standard_normal((208, 96)) * 0.05, qtype)
    )
    wb = w.bfloat16()
    assert pl.pack_bf16(wb, w + 1e-3) is None  # not the weight it was rounded from
    assert pl.pack_bf16(wb, w * 0.999) is None
    small = lin.small_batch_weights(wb, w)
    assert isinstance(small.packed, pl.PackedWeight)
    assert (small.reordered is None) != (small.blocked is None)  # one copy for the other rows
    for m in (1, 2, 3, 4, 5, 8, 31):
        x = torch.randn(m, 96, generator=g).bfloat16()
        got = pl.packed_linear(x, small.packed)
        assert got.dtype == torch.bfloat16 and got.shape == (m, 208)
        ref = (x.double() @ wb.double().T).float()
        torch.testing.assert_close(got.float(), ref, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("blocked", [False, True])
def test_bf16_batches_take_the_codes_up_to_a_few_rows(monkeypatch, kernel_switches, blocked):
    """Then the blocked bf16 copy where its kernel serves (AVX-512 BF16 without AMX), else the
    reordered one."""
    kernel_switches(packed_bf16=True)
    if blocked and not bf16_linear.available():
        pytest.skip(f"the blocked bf16 kernel is off here: {bf16_linear.why_not()}")
    if not blocked:
        kernel_switches(bf16_linear=False)
    w = torch.from_numpy(gguf_grid(np.random.default_rng(6).standard_normal((64, 32)), Q.Q4_1))
    small = lin.small_batch_weights(w.bfloat16(), w)
    packed, reordered = spy(monkeypatch, "_packed_linear"), spy(monkeypatch, "_onednn_linear")
    calls, real = [], bf16_linear.linear
    monkeypatch.setattr(bf16_linear, "linear", lambda x, bw: calls.append(len(x)) or real(x, bw))
    for m in range(1, 11):
        lin.linear(torch.randn(m, 32).bfloat16(), w.bfloat16(), small)
    assert packed == list(range(1, lin.PACKED_MAX_BF16 + 1))
    rest = list(range(lin.PACKED_MAX_BF16 + 1, 11))
    assert (calls, reordered) == ((rest, []) if blocked else ([], rest))


def spy(monkeypatch, name: str) -> list[int]:
    """The row counts `lin.<name>` is called with; the real op still runs."""
    calls, real = [], getattr(lin, name)
    monkeypatch.setattr(lin, name, lambda x, s, b: calls.append(len(x)) or real(x, s, b))
    return calls


def test_packed_codes_for_decode_batches_then_the_reordered_copy(monkeypatch):
    w = torch.from_numpy(gguf_grid(np.random.default_rng(3).standard_normal((64, 32)), Q.Q4_1))
    small = lin.small_batch_weights(w)
    assert small.packed is not None and small.reordered is not None
    packed, reordered = spy(monkeypatch, "_packed_linear"), spy(monkeypatch, "_onednn_linear")
    for m in range(1, lin.SMALL_MAX + 20):
        lin.linear(torch.randn(m, 32), w, small)
    assert packed == list(range(1, lin.PACKED_MAX + 1))
    assert reordered == list(range(lin.PACKED_MAX + 1, lin.SMALL_MAX + 1))


def test_the_switch_turns_it_off(monkeypatch, kernel_switches):
    """`--no-kernel-packed-weights`: nothing packs (bf16 opted in or not), the kernel is never
    called, and the product is the fp32 matmul's."""
    kernel_switches(packed_weights=False, packed_bf16=True)
    assert not pl.available() and not pl.bf16_available()
    assert pl.why_not() == "switched off: --no-kernel-packed-weights"
    w = torch.from_numpy(gguf_grid(np.random.default_rng(4).standard_normal((64, 32)), Q.Q4_1))
    small = lin.small_batch_weights(w)
    assert small.packed is None and small.reordered is not None  # the oneDNN copy alone
    assert lin.small_batch_weights(w.bfloat16(), w).packed is None
    packed = spy(monkeypatch, "_packed_linear")
    for m in (1, 4, 16):
        x = torch.randn(m, 32)
        torch.testing.assert_close(lin.linear(x, w, small), F.linear(x, w), rtol=1e-5, atol=1e-4)
    assert packed == []


def test_a_grid_model_switched_off_serves_the_same_tokens(tiny_grid, kernel_switches):
    """An engine whose config switches packed weights off (EngineConfig.kernels, as a node's
    `--no-kernel-packed-weights`) packs no weight and greedily serves the tokens the packed one
    serves."""
    path, _, seqs, _ = tiny_grid
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def serve(kernels: KernelSwitches) -> tuple[str, list[list[int]]]:
        eng = Engine(EngineConfig(model=str(path), dtype="float32", threads=1, kernels=kernels))
        layers = eng.runner.model.layers
        packed = sum(v.packed is not None for layer in layers for v in layer.small.values())
        return f"{packed} packed", [c.token_ids for c in eng.generate(seqs, params)]

    on, off = serve(KernelSwitches()), serve(KernelSwitches(packed_weights=False))
    assert on[0] != "0 packed" and off[0] == "0 packed"
    assert switches.current() == KernelSwitches(
        packed_weights=False
    )  # the engine's, until teardown
    assert off[1] == on[1]


def grid_model(path):
    """The tiny model with every matrix on a GGUF grid: Q4_1 layers, a Q8_0 embedding (as the
    default model ships)."""
    w = load_file(str(path / "model.safetensors"))
    for name, t in w.items():
        if t.dim() == 2:
            qtype = Q.Q8_0 if "embed" in name or "lm_head" in name else Q.Q4_1
            w[name] = torch.from_numpy(gguf_grid(t.numpy(), qtype))
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def tiny_grid(tmp_path_factory):
    path = grid_model(build_tiny_model(tmp_path_factory.mktemp("grid"), tie=True))
    assert json.loads((path / "config.json").read_text())["vocab_size"] % 4 == 0
    cfg = load_model_config(path)
    rng = random.Random(1)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    return path, cfg, seqs, hf_logits(path, seqs)


def test_a_grid_model_runs_packed_and_matches_transformers(tiny_grid, monkeypatch):
    path, cfg, seqs, ref = tiny_grid
    slices = [load_slice(path, 0, 2), load_slice(path, 2, 4)]
    for s in slices:
        s.add_small_batch_weights()
    small = [v for s in slices for layer in s.layers for v in layer.small.values()]
    assert small and all(isinstance(v.packed, pl.PackedWeight) for v in small)
    assert isinstance(slices[-1]._small_head.packed, pl.PackedWeight)
    rows = spy(monkeypatch, "_packed_linear")
    got = run_plan(slices, cfg, seqs, PLAN)
    assert rows  # the plan's decode steps went through the kernel
    assert max_err(got, ref) < 1e-4


def test_the_default_model_is_packed_whole():
    """SmolLM2-135M-Instruct ships as a Q4_1 GGUF with a Q8_0 embedding: its last layer's four
    matrices pack as 4-bit codes and its LM head as 8-bit ones, with every value given back."""
    s = load_slice(None, 29, 30)
    about = s.add_small_batch_weights()
    assert about.startswith("decode matmuls on packed block codes: 5 of 5 "), about
    layer = s.layers[0]
    for name, small in layer.small.items():
        assert isinstance(small.packed, pl.PackedWeight) and small.packed.bits == 4, name
        assert torch.equal(decode(small.packed), getattr(layer, f"{name}_weight"))
    head = s._small_head.packed
    assert isinstance(head, pl.PackedWeight) and head.bits == 8
    assert torch.equal(decode(head), s.lm_head_weight)


def test_the_default_model_in_bf16_is_packed_from_its_fp32_weights(kernel_switches):
    """Opted in (`--kernel-packed-bf16`), the codes come from the fp32 slice the bf16 one was
    rounded from: every matrix of the last layer and the LM head packs, and its codes round to the
    bf16 weights. By default a bf16 slice does not pack (nor load itself in fp32)."""
    kernel_switches(packed_bf16=False)
    s = load_slice(None, 29, 30, torch.bfloat16)
    loads = []
    about = s.add_small_batch_weights(lambda: loads.append(1))
    assert about.startswith("matmuls on ") and "no packed codes" in about and loads == [], about
    kernel_switches(packed_bf16=True)
    s = load_slice(None, 29, 30, torch.bfloat16)
    about = s.add_small_batch_weights(lambda: load_slice(None, 29, 30))
    assert about.startswith("decode matmuls on packed block codes: 5 of 5 "), about
    layer = s.layers[0]
    for name, small in layer.small.items():
        assert isinstance(small.packed, pl.PackedWeight), name
        assert torch.equal(decode(small.packed).bfloat16(), getattr(layer, f"{name}_weight"))
    assert torch.equal(decode(s._small_head.packed).bfloat16(), s.lm_head_weight)
