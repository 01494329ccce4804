"""The in-place extend (prefill) attention kernel (engine/kernels/csrc/extend_attention.cpp): bf16
on a CPU with AVX-512 BF16, against fp32 attention over the same bf16 keys and values, its causality
bit for bit, its bounds, and the model's use of it. Elsewhere the kernel does not exist and the
gather path serves (that path is what the rest of the suite runs)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.forward_batch import BatchItem, build_forward_batch
from pdserve.engine.kernels import cpu_kernels, paged_attention
from pdserve.engine.kv_cache import KVLayout, KVPool
from pdserve.engine.model.loader import load_model_config, load_slice
from tests.test_model import PLAN, TOTAL, hf_logits, max_err, run_plan, scattered_tables
from tests.tiny_model import build_tiny_model

PAGE = 16


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert paged_attention.load(), paged_attention.why_not()
    why = paged_attention.extend_why_not(3, 64, PAGE)
    if "AVX-512 BF16" in why:
        pytest.skip(f"this CPU has no extend kernel: {why}")
    assert not why, why


def make_case(seed, *, heads, kv_heads, d, items, wide=False):
    """items: (cached, new) per item. Returns q [T, heads, d] (rows of a wider tensor when
    `wide`), a layer's strided pool view, and the kernel's tables."""
    g = torch.Generator().manual_seed(seed)
    lens = [s + n for s, n in items]
    max_pages = max(-(-n // PAGE) for n in lens)
    num_pages = len(items) * max_pages + 3
    pool = torch.randn(num_pages, 2, 2, PAGE, kv_heads, d, generator=g).to(torch.bfloat16)
    tables = scattered_tables(lens, PAGE, num_pages, seed=seed)
    page_table = torch.tensor([t + [0] * (max_pages - len(t)) for t in tables])
    t = sum(n for _, n in items)
    cols = heads * d + (2 * kv_heads * d if wide else 0)
    q = torch.randn(t, cols, generator=g).to(torch.bfloat16)[:, : heads * d].view(t, heads, d)
    news = torch.tensor([n for _, n in items])
    firsts = torch.cumsum(news, 0) - news
    return q, pool[:, 1], page_table, torch.tensor(lens), news, firsts


def reference(q, kv, page_table, lens, news, firsts, window=0):
    """fp32 attention over the same bf16 inputs: each item's pages gathered, causal from its
    cached length (and within its last `window` positions, where > 0)."""
    ps, nkv, d = kv.shape[2], kv.shape[3], kv.shape[4]
    group = q.shape[1] // nkv
    out = torch.empty(q.shape)
    for b in range(len(lens)):
        n_keys, n, f = int(lens[b]), int(news[b]), int(firsts[b])
        pages = kv[page_table[b, : -(-n_keys // ps)]]
        keys = pages[:, 0].reshape(-1, nkv, d)[:n_keys].float().repeat_interleave(group, 1)
        vals = pages[:, 1].reshape(-1, nkv, d)[:n_keys].float().repeat_interleave(group, 1)
        qb = q[f : f + n].float()
        s = torch.einsum("thd,khd->htk", qb, keys) * d**-0.5
        pos = n_keys - n + torch.arange(n)[:, None]
        ok = torch.arange(n_keys)[None, :] <= pos
        if window:
            ok &= torch.arange(n_keys)[None, :] > pos - window
        p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
        out[f : f + n] = torch.einsum("htk,khd->thd", p, vals)
    return out


def run(q, kv, page_table, lens, news, firsts, out=None, window=0):
    out = torch.zeros(q.shape, dtype=torch.bfloat16) if out is None else out
    paged_attention.extend_attention_(
        out, q, kv, page_table, lens, news, firsts, q.shape[-1] ** -0.5, window
    )
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,d,items",
    [
        (9, 3, 64, [(0, 300)]),  # SmolLM2: a prompt from position 0, across chunks of keys
        (9, 3, 64, [(512, 300)]),  # after a cached system prompt
        (9, 3, 64, [(3, 2), (0, 17), (40, 33), (100, 64), (17, 129)]),  # several items, odd ends
        (4, 4, 64, [(15, 40)]),  # one query head per KV head
        (8, 4, 64, [(0, 70), (33, 5)]),  # two
        (8, 2, 64, [(129, 31)]),  # four
        (8, 4, 128, [(0, 45), (200, 20)]),  # head size 128, two
        (4, 4, 128, [(31, 3)]),
        (8, 2, 128, [(64, 64)]),
        (4, 1, 256, [(0, 300), (37, 20)]),  # head size 256, four (Gemma 3)
        (2, 2, 256, [(100, 33)]),
    ],
)
def test_equals_fp32_attention(heads, kv_heads, d, items):
    """Within the final rounding to bf16 and bf16 probabilities (as FlashAttention multiplies
    them) of fp32 attention over the same inputs; q as rows of the fused QKV output."""
    case = make_case(len(items), heads=heads, kv_heads=kv_heads, d=d, items=items, wide=True)
    assert not case[0].is_contiguous()
    got = run(*case)
    torch.testing.assert_close(got.float(), reference(*case), rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize("window", [1, 7, 100, 300])
@pytest.mark.parametrize("heads,kv_heads,d", [(4, 1, 128), (9, 3, 64), (4, 1, 256)])
def test_a_window_attends_to_the_last_positions_only(heads, kv_heads, d, window):
    """`window` > 0 (a sliding-window layer): a token attends to its last `window` positions,
    its own included, for a prompt from position 0, one after a cached prefix longer than the
    window, and chunks of keys the window skips whole (600 keys: three chunks of 256)."""
    items = [(0, 300), (400, 200), (5, 9)]
    case = make_case(window, heads=heads, kv_heads=kv_heads, d=d, items=items)
    got = run(*case, window=window)
    want = reference(*case, window=window)
    torch.testing.assert_close(got.float(), want, rtol=1.6e-2, atol=1.6e-2)


@pytest.mark.parametrize(
    "start,n,rows",
    [
        (100, 70, (0, 17, 31, 32, 69)),  # across the kernel's 32-token blocks
        (200, 100, (0, 55, 56, 57, 99)),  # across its 256-key chunks (row 55 is key 255)
    ],
)
def test_rows_see_no_later_key_bit_for_bit(start, n, rows):
    """Causal, exactly: changing the keys and values after a row's own position (to large values)
    leaves the row's output bit for bit, and slots past the item's end (NaN, as a stale page may
    hold anything) are never read into it."""
    q, kv, pt, lens, news, firsts = make_case(1, heads=9, kv_heads=3, d=64, items=[(start, n)])
    base = run(q, kv, pt, lens, news, firsts)
    assert torch.isfinite(base.float()).all()
    for row in rows:
        changed = kv.clone()
        for key in range(start + row + 1, 16 * pt.shape[1]):
            page, off = pt[0, key // PAGE], key % PAGE
            fill = float("nan") if key >= start + n else 300.0
            changed[page, :, off] = fill
        got = run(q, changed, pt, lens, news, firsts)
        assert torch.equal(got[: row + 1], base[: row + 1]), row
        if row < n - 1:
            assert not torch.equal(got[row + 1], base[row + 1])


def test_rows_of_other_items_are_left_alone():
    """Only the items' rows of `out` are written: a mixed batch's decode rows are another
    kernel's."""
    q, kv, pt, lens, news, firsts = make_case(2, heads=9, kv_heads=3, d=64, items=[(0, 40)])
    t = 45  # rows 0-1 and 42-44 belong to others
    qq = torch.zeros(t, 9, 64, dtype=torch.bfloat16)
    qq[2:42] = q
    out = torch.full((t, 9, 64), 7.0, dtype=torch.bfloat16)
    run(qq, kv, pt, lens, news, torch.tensor([2]), out=out)
    assert (out[:2] == 7).all() and (out[42:] == 7).all()
    torch.testing.assert_close(out[2:42], run(q, kv, pt, lens, news, firsts))


def test_bad_tables_are_refused_not_read():
    q, kv, pt, lens, news, firsts = make_case(3, heads=9, kv_heads=3, d=64, items=[(5, 20)])
    bad = pt.clone()
    bad[0, 1] = kv.shape[0]
    with pytest.raises(RuntimeError, match="page_table"):
        run(q, kv, bad, lens, news, firsts)
    with pytest.raises(RuntimeError, match="out of range"):
        run(q, kv, pt, torch.tensor([40]), news, firsts)  # more keys than the table holds
    with pytest.raises(RuntimeError, match="out of range"):
        run(q, kv, pt, lens, torch.tensor([26]), firsts)  # more new tokens than keys
    with pytest.raises(RuntimeError, match="first_rows"):
        run(q, kv, pt, lens, news, torch.tensor([1]))  # rows past q
    two = [torch.cat([x, x]) for x in (lens, news)]
    with pytest.raises(RuntimeError, match="overlap"):  # two items writing the same rows
        run(q, kv, torch.cat([pt, pt]), *two, torch.tensor([0, 0]))
    with pytest.raises(RuntimeError, match="bf16"):
        run(q.float(), kv, pt, lens, news, firsts)


def test_one_extend_group():
    items = [
        BatchItem([0, 1], 0, 20, True),
        BatchItem([2], 4, 1, True),
        BatchItem([3, 4, 5], 30, 3, False),
    ]
    fb = build_forward_batch(items, PAGE, one_decode_group=True, one_extend_group=True)
    decode, extend = fb.groups
    assert decode.first_rows is None and decode.seq_lens.tolist() == [5]
    assert extend.first_rows.tolist() == [0, 21] and extend.num_new.tolist() == [20, 3]
    assert extend.seq_lens.tolist() == [20, 33] and extend.mask is None
    assert extend.kv_pages.view(2, extend.pages).tolist() == [[0, 1, 0], [3, 4, 5]]


@pytest.fixture(scope="module")
def tiny_head64(tmp_path_factory):
    """A tiny Llama with SmolLM2's head size and query heads per KV head."""
    path = build_tiny_model(
        tmp_path_factory.mktemp("head64"), hidden=192, heads=3, kv_heads=1, intermediate=256
    )
    cfg = load_model_config(path)
    rng = random.Random(1)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    return path, cfg, seqs, hf_logits(path, seqs)


def pool(s, cfg, dtype):
    return KVPool(
        KVLayout(8, PAGE, s.layer_start, s.layer_end, cfg.num_kv_heads, cfg.head_dim, dtype)
    )


def test_the_model_prefills_with_it(tiny_head64, monkeypatch):
    """A bf16 slice picks the kernel; prefill chunks (from position 0, after a cached chunk,
    short ones grouped with decodes) go through it (counted), and agree with transformers in fp32
    as closely as the gather path's bf16 SDPA does."""
    path, cfg, seqs, ref = tiny_head64
    calls = []
    real = paged_attention.extend_attention_

    def counted(*a):
        calls.append(int(a[5].sum()))
        return real(*a)

    monkeypatch.setattr(paged_attention, "extend_attention_", counted)
    bf16 = dict(page_size=PAGE, dtype=torch.bfloat16)
    s = load_slice(path, 0, 4, dtype=torch.bfloat16)
    assert s.choose_extend_attention(pool(s, cfg, torch.bfloat16))
    fp32 = load_slice(path, 0, 4)
    assert not fp32.choose_extend_attention(pool(fp32, cfg, torch.float32))
    got = run_plan([s], cfg, seqs, PLAN, one_group=True, one_extend_group=True, **bf16)
    extend_tokens = sum(n for step in PLAN for _, n, _ in step if n > 1)
    assert sum(calls) == extend_tokens * cfg.num_layers
    gathered = run_plan([s], cfg, seqs, PLAN, one_group=True, **bf16)
    assert sum(calls) == extend_tokens * cfg.num_layers  # the gather path: no call
    assert max_err(got, ref) < 0.1
    assert max_err(got, ref) < 1.5 * max_err(gathered, ref)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_a_sliding_window_model_prefills_with_it(tmp_path, monkeypatch, head_dim):
    """A tiny Gemma 3 (windows of 7 tokens on three of four layers), of head size 64 and of Gemma
    3 270M's 256: its bf16 prefill chunks go through the kernel, told each sliding layer's window,
    and agree with transformers in fp32 as closely as the gather path's bf16 SDPA with window
    masks does. Head size 256 is the kernel's choice only on a CPU without AMX (there SDPA's bf16
    on the tile units is faster); it is forced here on either."""
    path = build_tiny_model(tmp_path / "gemma3", arch="gemma3", tie=True, head_dim=head_dim)
    cfg = load_model_config(path)
    rng = random.Random(1)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    ref = hf_logits(path, seqs)
    windows = []
    real = paged_attention.extend_attention_

    def counted(*a):
        windows.append(a[8] if len(a) > 8 else 0)
        return real(*a)

    monkeypatch.setattr(paged_attention, "extend_attention_", counted)
    bf16 = dict(page_size=PAGE, dtype=torch.bfloat16)
    s = load_slice(path, 0, 4, dtype=torch.bfloat16)
    amx = "amx_bf16" in cpu_kernels.cpu_flags().split()
    assert s.choose_extend_attention(pool(s, cfg, torch.bfloat16)) == (head_dim == 64 or not amx)
    s._extend_in_place = True
    got = run_plan([s], cfg, seqs, PLAN, one_group=True, one_extend_group=True, **bf16)
    assert windows.count(cfg.sliding_window) == 3 * windows.count(0) > 0
    gathered = run_plan([s], cfg, seqs, PLAN, one_group=True, **bf16)
    # bf16 moves this model further than a Llama (norms of 1 + w, on both sides of each block):
    # the gather path's own error here is about 0.17 at head size 64, 0.49 at 256
    assert max_err(got, ref) < (0.3 if head_dim == 64 else 0.6)
    assert max_err(got, ref) < 1.5 * max_err(gathered, ref)
