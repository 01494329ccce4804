"""The fused per-layer ops (engine/kernels/layer_ops.py, engine/kernels/csrc/layer_ops.cpp) against
the Hugging Face modules' arithmetic, and the model's use of them. The kernels are built by
`scripts/setup.sh`; a checkout where they are missing fails here, on purpose: serving would fall
back to the torch ops."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import layer_ops
from pdserve.engine.model.loader import load_model_config, load_slice
from pdserve.engine.model.rope import RopeTable
from tests.test_model import PLAN, TOTAL, hf_logits, max_err, run_plan
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert layer_ops.load(), layer_ops.cpu_kernels.why_not()


def hf_rms_norm(x, w, eps):
    """LlamaRMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def hf_rope(x, cos, sin):
    """apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, three roundings."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("width", [64, 100, 576])
def test_rms_norm_is_the_hf_module(rows, width):
    """fp32: within a few ulp (only the order of the sum of squares differs); bf16: the same bits
    on these rows (the normalized x is rounded to bf16 before the weight, as the HF module does;
    the fp32 sum order could, rarely, move one rounding). Rows that are a strided view give what
    their contiguous copy gives."""
    g = torch.Generator().manual_seed(rows * width)
    x = torch.randn(rows, width + 8, generator=g) * 3
    w = torch.randn(width, generator=g)
    got = layer_ops.rms_norm(x[:, :width], w, 1e-5)
    ref = hf_rms_norm(x[:, :width].double(), w.double(), 1e-5)
    assert ((got.double() - ref).abs() / ref.abs().clamp_min(1e-3)).max() < 1e-6
    assert torch.equal(got, layer_ops.rms_norm(x[:, :width].contiguous(), w, 1e-5))
    xb, wb = x[:, :width].bfloat16(), w.bfloat16()
    assert torch.equal(layer_ops.rms_norm(xb, wb, 1e-5), hf_rms_norm(xb, wb, 1e-5))


def test_silu_mul_is_within_4e_7_of_exact():
    """Where silu is a normal float (gate >= -80); below that, next to 0 (exp is clamped: no inf,
    no NaN)."""
    g = torch.cat([torch.linspace(-80, 100, 18001), torch.randn(20000) * 4, torch.tensor([0.0])])
    up = torch.randn(g.numel(), generator=torch.Generator().manual_seed(0))
    got = layer_ops.silu_mul(torch.cat([g, up]).view(1, -1))[0]
    exact = F.silu(g.double()) * up.double()
    assert ((got.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max() < 4e-7
    assert got[-1] == 0.0
    far = layer_ops.silu_mul(torch.tensor([[-1e4, -90.0, 1e4, 1.0, 1.0, 1.0]]))[0]
    assert far[0].abs() < 1e-30 and far[1].abs() < 1e-30 and far[2] == 1e4


def rope_case(dtype, tokens=13, nh=9, nkv=3, d=64, page_size=16, pages=10):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (nh + 2 * nkv) * d, generator=g).to(dtype)
    table = RopeTable(d, 10000.0, None, 4096, dtype)
    pos = torch.randint(0, 3000, (tokens,), generator=g)
    rope = table.lookup(pos, int(pos.max()))
    slots = torch.randperm(pages * page_size, generator=g)[:tokens]
    pool = torch.full((pages, 3, 2, page_size, nkv, d), 7.0, dtype=dtype)  # 3 layers
    return qkv, rope, pool, slots // page_size, slots % page_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_rotates_as_hf_and_stores_each_token(dtype):
    """q and k rotated in place with the HF module's bits; k and v copied to their slots of this
    layer; v, the other slots and the other layers untouched."""
    nh, nkv, d = 9, 3, 64
    qkv, rope, pool, pages, offs = rope_case(dtype)
    before, want_pool = qkv.clone(), pool.clone()
    t = qkv.shape[0]
    qk = hf_rope(before[:, : (nh + nkv) * d].view(t, nh + nkv, d), *rope)
    want_pool[pages, 1, 0, offs] = qk[:, nh:]
    want_pool[pages, 1, 1, offs] = before[:, (nh + nkv) * d :].view(t, nkv, d)
    assert layer_ops.rope_store_kv_(qkv, rope, pool[:, 1], pages, offs, nh, nkv)
    assert torch.equal(qkv[:, : (nh + nkv) * d], qk.reshape(t, -1))
    assert torch.equal(qkv[:, (nh + nkv) * d :], before[:, (nh + nkv) * d :])
    assert torch.equal(pool, want_pool)


def test_a_bad_slot_is_refused_and_nothing_is_written():
    qkv, rope, pool, pages, offs = rope_case(torch.float32)
    before = pool.clone()
    for bad_pages, bad_offs in ((pages.clone(), offs), (pages, offs.clone())):
        (bad_pages if bad_pages is not pages else bad_offs)[-1] = 10_000
        with pytest.raises(RuntimeError, match="out of range"):
            layer_ops.rope_store_kv_(qkv, rope, pool[:, 0], bad_pages, bad_offs, 9, 3)
    assert torch.equal(pool, before)


def test_rows_that_overlap_or_a_negative_head_count_are_refused():
    qkv, rope, pool, pages, offs = rope_case(torch.float32)
    before = pool.clone()
    with pytest.raises(RuntimeError, match="nh must be"):
        layer_ops.rope_store_kv_(qkv, rope, pool[:, 0], pages, offs, -1, 3)
    shared = qkv[:1].expand(qkv.shape[0], -1)  # every row the same memory
    with pytest.raises(RuntimeError, match="rows"):
        layer_ops.rope_store_kv_(shared, rope, pool[:, 0], pages, offs, 9, 3)
    assert torch.equal(pool, before)


def test_other_dtypes_take_the_torch_ops():
    x, w = torch.randn(3, 64, dtype=torch.float16), torch.randn(64, dtype=torch.float16)
    assert torch.equal(layer_ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5))
    qkv, rope, pool, pages, offs = rope_case(torch.float16)
    assert not layer_ops.rope_store_kv_(qkv, rope, pool[:, 0], pages, offs, 9, 3)


def test_the_model_runs_them_and_matches_transformers(tmp_path, kernel_switches):
    """The tiny model over a plan of prefill chunks and decodes: the ops run (profiled), the logits
    match transformers, and match the torch ops' within float rounding; switched off
    (`--no-kernel-layer-ops`), none of them runs."""
    path = build_tiny_model(tmp_path)
    cfg = load_model_config(path)
    rng = random.Random(1)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    ref = hf_logits(path, seqs)
    slices = [load_slice(path, 0, 3), load_slice(path, 3, 4)]
    ops = {"pdserve::rms_norm", "pdserve::silu_mul", "pdserve::rope_store_kv_"}
    with torch.profiler.profile() as prof:
        got = run_plan(slices, cfg, seqs, PLAN)
    assert ops <= {e.key for e in prof.key_averages()}
    assert max_err(got, ref) < 1e-4
    kernel_switches(layer_ops=False)
    assert not layer_ops.load() and layer_ops.why_not() == "switched off: --no-kernel-layer-ops"
    with torch.profiler.profile() as prof:
        torch_ops = run_plan(slices, cfg, seqs, PLAN)
    assert not ops & {e.key for e in prof.key_averages()}
    kernel_switches(layer_ops=True)
    assert layer_ops.load()  # decided again under the switches in use
    assert max((got[k] - torch_ops[k]).abs().max() / torch_ops[k].abs().max() for k in got) < 1e-5
