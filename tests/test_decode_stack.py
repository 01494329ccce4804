"""A bf16 slice's decode forward in one C++ call (engine/kernels/decode_stack.py): bit for bit the
layer loop's results, on the paths where it applies and only there; bad calls refused before
anything is written."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.forward_batch import BatchItem, build_forward_batch
from pdserve.engine.kernels import decode_stack
from pdserve.engine.kernels.switches import KernelSwitches
from pdserve.engine.kv_cache import KVLayout, KVPool
from pdserve.engine.model.loader import load_model_config, load_slice
from tests.test_bf16_linear import (  # noqa: F401 (autouse: the blocked kernel, or skip)
    INVARIANT,
    kernel,
)
from tests.test_model import DECODE_STEPS, PLAN, TOTAL, run_plan
from tests.tiny_model import build_tiny_model

# (name, build_tiny_model arguments): SmolLM2's head shape (3 query heads per KV head of 64, the
# bf16 dot-product attention kernel), another one (the generic attention loop), and q/k/v biases
SHAPES = {
    "smollm2_heads": dict(hidden=192, heads=3, kv_heads=1, intermediate=256),
    "two_kv_heads": dict(hidden=96, heads=6, kv_heads=2, intermediate=160),
    "qkv_bias": dict(hidden=192, heads=3, kv_heads=1, intermediate=256, arch="qwen2"),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def tiny(request, tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp(request.param), **SHAPES[request.param])
    cfg = load_model_config(path)
    rng = random.Random(5)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    return path, cfg, seqs


def bf16_slice(path, start=0, end=4):
    s = load_slice(path, start, end, dtype=torch.bfloat16)
    s.add_small_batch_weights(batch_invariant=INVARIANT)
    return s


def counted_calls(monkeypatch) -> list[int]:
    calls = []
    real = decode_stack.run_

    def counted(h, *a):
        calls.append(h.shape[0])
        return real(h, *a)

    monkeypatch.setattr(decode_stack, "run_", counted)
    return calls


def test_one_call_is_bit_identical_to_the_layer_loop(tiny, monkeypatch):
    """The plan's all-decode steps (5 requests, scattered pages, batches before them mixed) run in
    one call, and every logit equals the layer loop's on the same kernels, over two PP slices: the
    later steps read the keys and values the call stored."""
    path, cfg, seqs = tiny
    calls = counted_calls(monkeypatch)
    stacked = [bf16_slice(path, 0, 2), bf16_slice(path, 2, 4)]
    assert all(s._stack is not None for s in stacked)
    got = run_plan(stacked, cfg, seqs, PLAN, dtype=torch.bfloat16, one_group=True)
    assert calls == [len(PLAN[-1])] * DECODE_STEPS * 2  # each decode step, both slices
    loop = [bf16_slice(path, 0, 2), bf16_slice(path, 2, 4)]
    for s in loop:
        s._stack = None
    calls.clear()
    want = run_plan(loop, cfg, seqs, PLAN, dtype=torch.bfloat16, one_group=True)
    assert calls == []
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_the_engine_decodes_in_one_call_with_the_same_tokens(tiny, monkeypatch, kernel_switches):
    """Served end to end (the runner's one decode group, sampling at temperature 1 with a seed):
    the same tokens with the call on and off (an engine whose config switches it off)."""
    path, _, seqs = tiny
    calls = counted_calls(monkeypatch)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3)

    def tokens(kernels=KernelSwitches()):
        cfg = EngineConfig(
            model=str(path),
            dtype="bfloat16",
            threads=1,
            batch_invariant=INVARIANT,
            kernels=kernels,
        )
        eng = Engine(cfg)
        return [c.token_ids for c in eng.generate([s[:20] for s in seqs], params)]

    on = tokens()
    assert sum(c == len(seqs) for c in calls) >= 11  # the decode steps
    # batch-invariant, the prefill runs in the call too: every token is a decode query there
    assert max(calls) == (sum(min(20, len(s)) for s in seqs) if INVARIANT else len(seqs))
    calls.clear()
    assert tokens(KernelSwitches(decode_stack=False)) == on and calls == []


def test_where_it_does_not_apply(tmp_path, monkeypatch, kernel_switches):
    """Off by its switch, for fp32 slices, for layers with q/k norms and where packed codes serve
    small batches, and the ready line says which way decode steps run; a mixed batch takes the
    loop."""
    path = build_tiny_model(tmp_path / "llama", hidden=96, heads=3, kv_heads=1)
    s = load_slice(path, 0, 4, dtype=torch.bfloat16)
    assert "decode steps in one call" in s.add_small_batch_weights(batch_invariant=INVARIANT)
    fp32 = load_slice(path, 0, 4, dtype=torch.float32)
    fp32.add_small_batch_weights()
    assert fp32._stack is None and decode_stack.why_not(fp32) == "not a bf16 slice"
    qwen3 = build_tiny_model(tmp_path / "qwen3", hidden=96, heads=3, kv_heads=1, arch="qwen3")
    q3 = load_slice(qwen3, 0, 4, dtype=torch.bfloat16)
    assert "per op (the layers have q/k norms)" in q3.add_small_batch_weights(
        batch_invariant=INVARIANT
    )
    assert q3._stack is None
    # packed block codes (the --kernel-packed-bf16 opt-in) would serve the loop's small batches
    packed = load_slice(path, 0, 4, dtype=torch.bfloat16)
    packed.add_small_batch_weights(batch_invariant=INVARIANT)
    layer = packed.layers[2]
    layer.small["o"] = dataclasses.replace(layer.small["o"], packed=layer.small["o"].blocked)
    assert decode_stack.why_not(packed) == (
        "small batches take packed block codes (--kernel-packed-bf16)"
    )
    kernel_switches(decode_stack=False)
    off = load_slice(path, 0, 4, dtype=torch.bfloat16)
    assert "per op (switched off: --no-kernel-decode-stack)" in off.add_small_batch_weights(
        batch_invariant=INVARIANT
    )
    assert off._stack is None
    # a batch with a prefill chunk in it takes the loop even where the call is on
    calls = counted_calls(monkeypatch)
    cfg = load_model_config(path)
    pool = KVPool(KVLayout(4, 16, 0, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16))
    items = [BatchItem([0], 4, 1, True), BatchItem([1], 0, 6, True)]
    fb = build_forward_batch(
        items, 16, one_decode_group=True, one_extend_group=s.choose_extend_attention(pool)
    )
    s(torch.arange(7), fb, pool)
    assert calls == []


def decode_call(s, cfg, pool, weights, rows=2):
    """The kernel called directly for `rows` decode rows of the slice, with these weights."""
    items = [BatchItem([2 * r, 2 * r + 1], 3, 1, True) for r in range(rows)]
    fb = build_forward_batch(items, 4, one_decode_group=True)
    g = fb.groups[0]
    h = torch.randn(rows, cfg.hidden_size).to(torch.bfloat16)
    before = (h.clone(), pool.kv.clone())
    cos, sin = s.rope.lookup(fb.positions, fb.max_position)
    args = (cos, sin, pool.kv, fb.out_pages, fb.out_offs, g.kv_pages.view(rows, -1), g.seq_lens)
    with pytest.raises(RuntimeError) as e:
        torch.ops.pdserve.decode_stack_(
            h, weights, [], *args, cfg.num_heads, cfg.num_kv_heads, 1e-5, 0.125
        )
    assert torch.equal(h, before[0]) and torch.equal(pool.kv, before[1])
    return str(e.value)


def test_bad_calls_are_refused_before_anything_is_written(tmp_path):
    path = build_tiny_model(tmp_path, hidden=96, heads=3, kv_heads=1)
    cfg = load_model_config(path)
    s = bf16_slice(path)
    pool = KVPool(KVLayout(8, 4, 0, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16))
    w = list(s._stack.weights)
    assert "23 weights for 4 layers" in decode_call(s, cfg, pool, w[:-1])
    bad = w[:]  # the last layer's down weight in place of its gate_up: found before layer 0 runs
    bad[-2] = w[-1]
    assert "layer 3's gate_up weight is not blocked" in decode_call(s, cfg, pool, bad)
    bad = w[:]
    bad[-3] = w[-3][:-1]  # a norm weight one short
    assert "layer 3's norm weights" in decode_call(s, cfg, pool, bad)
    bad = w[:]
    bad[7] = w[7].float()  # layer 1's qkv weight in fp32
    assert "layer 1's qkv weight is not blocked" in decode_call(s, cfg, pool, bad)
