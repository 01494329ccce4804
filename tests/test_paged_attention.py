"""The in-place decode attention kernel (engine/kernels/csrc/paged_attention.cpp) against gather +
SDPA, and the model's use of it. The kernel is built by `scripts/setup.sh`; a checkout where it is
missing fails here, on purpose: serving would silently fall back to the slower gather path."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.kernels import paged_attention
from pdserve.engine.model.loader import load_model_config, load_slice
from tests.cluster import ROOT
from tests.test_model import PLAN, TOTAL, hf_logits, max_err, run_plan, scattered_tables
from tests.tiny_model import build_tiny_model


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert paged_attention.load(), paged_attention.why_not()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("llama"))
    cfg = load_model_config(path)
    rng = random.Random(1)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    return path, cfg, seqs, hf_logits(path, seqs)


def reference(q, kv, page_table, lens, window: int = 0):
    """Gather the pages, mask past each length (and before its window), SDPA: what the model
    does without the kernel."""
    b, nh, d = q.shape
    ps, nkv = kv.shape[2], kv.shape[3]
    n = page_table.shape[1] * ps
    keys = kv[:, 0].index_select(0, page_table.flatten()).view(b, n, nkv, d).transpose(1, 2)
    vals = kv[:, 1].index_select(0, page_table.flatten()).view(b, n, nkv, d).transpose(1, 2)
    ok = torch.arange(n)[None, :] < lens[:, None]
    if window:
        ok &= torch.arange(n)[None, :] >= lens[:, None] - window
    mask = torch.zeros(b, 1, 1, n).masked_fill_(~ok[:, None, None, :], float("-inf"))
    o = F.scaled_dot_product_attention(
        q.float().view(b, nkv, nh // nkv, d), keys.float(), vals.float(), attn_mask=mask
    )
    return o.reshape(b, nh, d)


def make_case(seed, *, heads, kv_heads, page_size, lens, dtype=torch.float32, layers=3, d=32):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(-(-n // page_size) for n in lens)
    num_pages = len(lens) * max_pages + 5
    pool = torch.randn(num_pages, layers, 2, page_size, kv_heads, d, generator=g).to(dtype)
    tables = scattered_tables(lens, page_size, num_pages, seed=seed)
    page_table = torch.tensor([t + [0] * (max_pages - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return q, pool[:, 1], page_table, torch.tensor(lens)  # a strided view: layer 1 of 3


@pytest.mark.parametrize(
    "heads,kv_heads,page_size,lens,d",
    [
        (4, 4, 4, [1, 2, 3, 4, 5, 17], 32),  # MHA; one key; lengths across page ends
        (9, 3, 16, [1, 16, 33, 300, 512], 64),  # SmolLM2's GQA and head size, 16-token pages
        (8, 2, 1, [1, 7, 64], 128),  # page size 1
        (6, 1, 5, [9, 10, 11, 250], 32),  # MQA, an odd page size
        # head sizes off the vector paths: scores in blocks of 8 only, and neither
        (6, 2, 16, [3, 40, 99], 40),
        (4, 2, 16, [3, 40, 99], 20),
    ],
)
def test_fp32_equals_gather_and_sdpa(heads, kv_heads, page_size, lens, d):
    q, kv, pt, n = make_case(
        len(lens), heads=heads, kv_heads=kv_heads, page_size=page_size, lens=lens, d=d
    )
    got = paged_attention.decode_attention(q, kv, pt, n, q.shape[-1] ** -0.5)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, reference(q, kv, pt, n), rtol=1e-5, atol=2e-6)


def test_bf16_pool_sums_in_fp32():
    q, kv, pt, n = make_case(
        7, heads=9, kv_heads=3, page_size=16, lens=[5, 100, 400], dtype=torch.bfloat16
    )
    got = paged_attention.decode_attention(q, kv, pt, n, q.shape[-1] ** -0.5)
    assert got.dtype == torch.bfloat16
    # same inputs, fp32 arithmetic: only the final rounding to bf16 differs
    torch.testing.assert_close(got.float(), reference(q, kv, pt, n), rtol=8e-3, atol=8e-3)
    fp32_q = paged_attention.decode_attention(q.float(), kv, pt, n, q.shape[-1] ** -0.5)
    torch.testing.assert_close(fp32_q, reference(q, kv, pt, n), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "heads,kv_heads,page_size,lens,d",
    [
        (9, 3, 16, [1, 15, 16, 17, 300, 513], 64),  # SmolLM2: lengths across page ends
        (4, 4, 16, [2, 33], 64),  # one query head per KV head
        (8, 2, 5, [1, 5, 6, 99], 64),  # pages of fewer than 16 tokens
        (8, 4, 16, [7, 130], 128),  # head size 128
        (4, 1, 16, [1, 17, 300], 256),  # Gemma 3 270M: head size 256, one KV head
        (12, 2, 16, [40], 64),  # 6 query heads per KV head: the generic path
    ],
)
def test_bf16_equals_gather_and_sdpa(heads, kv_heads, page_size, lens, d):
    """bf16 query and pool, the shapes the AVX-512 BF16 path takes where the CPU has it (bf16 dot
    products, exact and summed in fp32) and one it leaves to the generic path: within the final
    rounding to bf16 of the fp32 result."""
    q, kv, pt, n = make_case(
        3,
        heads=heads,
        kv_heads=kv_heads,
        page_size=page_size,
        lens=lens,
        d=d,
        dtype=torch.bfloat16,
    )
    got = paged_attention.decode_attention(q, kv, pt, n, d**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    torch.testing.assert_close(got.float(), reference(q, kv, pt, n), rtol=8e-3, atol=8e-3)


@pytest.mark.parametrize(
    "dtype,heads,kv_heads,d",
    [
        (torch.float32, 4, 1, 256),  # Gemma 3 270M's heads
        (torch.bfloat16, 4, 1, 256),  # the same in bf16 (the AVX-512 BF16 path where there is one)
        (torch.bfloat16, 9, 3, 64),  # a shape the AVX-512 BF16 path takes
        (torch.float32, 6, 2, 32),
    ],
)
@pytest.mark.parametrize("window", [1, 7, 16, 40])
def test_a_window_attends_to_the_last_keys_only(dtype, heads, kv_heads, d, window):
    """`window` > 0 (a sliding-window layer): each request attends to its last `window` keys,
    whether the window starts inside a page, on a page's first key or before the first key. The
    keys before it are poisoned with NaN, so a read of one would show."""
    lens = [1, 6, 7, 8, 16, 17, 40, 41, 99]
    q, kv, pt, n = make_case(
        window, heads=heads, kv_heads=kv_heads, page_size=16, lens=lens, d=d, dtype=dtype
    )
    want = reference(q, kv, pt, n, window)
    for b, length in enumerate(lens):  # NaN in every key and value before the window
        for pos in range(max(0, length - window)):
            kv[pt[b, pos // 16], :, pos % 16] = float("nan")
    got = paged_attention.decode_attention(q, kv, pt, n, d**-0.5, window)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_rows_of_a_wider_tensor(dtype):
    """q as the layer has it for an all-decode batch: each request's heads are the first columns
    of its row of the fused QKV output (a stride between requests wider than heads * head_dim).
    The kernel reads it as it lies and returns a contiguous result equal to the packed query's."""
    heads, kv_heads, d, lens = 9, 3, 64, [1, 17, 300]
    q, kv, pt, n = make_case(
        5, heads=heads, kv_heads=kv_heads, page_size=16, lens=lens, d=d, dtype=dtype
    )
    qkv = torch.cat([q.view(len(lens), heads * d), torch.randn(len(lens), 2 * kv_heads * d)], 1)
    rows = qkv.to(dtype)[:, : heads * d].view(len(lens), heads, d)
    assert not rows.is_contiguous()
    got = paged_attention.decode_attention(rows, kv, pt, n, d**-0.5)
    assert got.is_contiguous() and got.shape == q.shape
    torch.testing.assert_close(got, paged_attention.decode_attention(q, kv, pt, n, d**-0.5))
    with pytest.raises(RuntimeError, match="head_dim contiguous"):
        paged_attention.decode_attention(q.transpose(1, 2), kv, pt, n, d**-0.5)


def test_bad_tables_are_refused_not_read():
    q, kv, pt, n = make_case(3, heads=4, kv_heads=2, page_size=4, lens=[6, 8])
    scale = q.shape[-1] ** -0.5
    bad = pt.clone()
    bad[1, 1] = kv.shape[0]  # one page past the pool
    with pytest.raises(RuntimeError, match="page_table"):
        paged_attention.decode_attention(q, kv, bad, n, scale)
    with pytest.raises(RuntimeError, match="seq_lens"):
        paged_attention.decode_attention(q, kv, pt, torch.tensor([6, 0]), scale)
    with pytest.raises(RuntimeError, match="seq_lens"):
        paged_attention.decode_attention(q, kv, pt, torch.tensor([6, 9]), scale)  # > 2 pages
    with pytest.raises(RuntimeError, match="int64"):
        paged_attention.decode_attention(q, kv, pt.int(), n, scale)


def test_the_model_decodes_with_it(tiny_llama, monkeypatch):
    """Decode groups go through the kernel (counted), prefill through SDPA, and both paths agree
    with transformers and with each other."""
    path, cfg, seqs, ref = tiny_llama
    calls = []
    real = paged_attention.decode_attention

    def counted(*a):
        calls.append(a[0].shape[0])
        return real(*a)

    monkeypatch.setattr(paged_attention, "decode_attention", counted)

    slices = [load_slice(path, 0, 3), load_slice(path, 3, 4)]
    got = run_plan(slices, cfg, seqs, PLAN)
    assert calls and all(s._in_place for s in slices)
    decode_items = sum(n == 1 for step in PLAN for _, n, _ in step)
    assert sum(calls) == decode_items * len(cfg_layers(slices))
    assert max_err(got, ref) < 1e-4
    one_group = run_plan(slices, cfg, seqs, PLAN, one_group=True)  # as the runner builds it
    assert sum(calls) == 2 * decode_items * len(cfg_layers(slices))
    assert all(torch.equal(one_group[k], got[k]) for k in got)
    for s in slices:
        s._in_place = False  # the gather path, as on a machine without the kernel
    gathered = run_plan(slices, cfg, seqs, PLAN)
    assert (
        max((got[k] - gathered[k]).abs().max().item() / gathered[k].abs().max().item() for k in got)
        < 1e-5
    )


def test_switched_off_the_model_gathers_and_matches(tiny_llama, monkeypatch, kernel_switches):
    """`--no-kernel-paged-attention`: the kernels say they are off and why, a slice loaded then
    gathers its pages, the kernel is never called, and the logits are the kernel's within
    rounding; `--no-kernel-extend-attention` turns off the extend kernel alone."""
    path, cfg, seqs, ref = tiny_llama
    on = run_plan([load_slice(path, 0, 4)], cfg, seqs, PLAN)
    kernel_switches(paged_attention=False)
    off_why = "switched off: --no-kernel-paged-attention"
    assert not paged_attention.load() and paged_attention.why_not() == off_why
    assert paged_attention.extend_why_not(3, 64, 16) == off_why
    calls = []
    monkeypatch.setattr(paged_attention, "decode_attention", lambda *a: calls.append(a))
    s = load_slice(path, 0, 4)
    off = run_plan([s], cfg, seqs, PLAN)
    assert calls == [] and s._in_place is False
    assert max_err(off, ref) < 1e-4
    assert max((on[k] - off[k]).abs().max().item() / off[k].abs().max().item() for k in on) < 1e-5
    kernel_switches(paged_attention=True, extend_attention=False)
    assert paged_attention.load() and not paged_attention.why_not()
    assert paged_attention.extend_why_not(3, 64, 16) == "switched off: --no-kernel-extend-attention"


def cfg_layers(slices):
    return [layer for s in slices for layer in s.layers]


def _load_in_child(env_extra: dict, timeout: float) -> tuple[bool, str]:
    """`load()` in a fresh interpreter (its once-per-process state stays out of this one)."""
    code = (
        "from pdserve.engine.kernels import paged_attention as p; "
        "ok = p.load(); print(ok); print(p.why_not())"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env_extra},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stderr
    ok, why = (r.stdout.splitlines() + ["", ""])[:2]
    return ok == "True", why


def test_no_build_place_means_the_gather_path_not_a_dead_rank(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    ok, why = _load_in_child({"PDSERVE_EXT_DIR": str(blocker / "ext")}, timeout=60)
    assert not ok and why  # the folder cannot be made under a file: said, not raised


def test_a_build_left_half_done_is_rebuilt_not_waited_for(tmp_path):
    """A builder killed mid-build leaves torch's lock file; the next build must not wait on it
    forever (our own flock died with the builder). The objects of the session's own build, when
    there is one, are copied first, so ninja links only (a whole compile is 30 to 100 s of both
    cores, 120 s and more under the sanitizers); without one, or where they are older than the
    sources (a build cache kept from an earlier checkout of the same sources), it compiles
    everything, so the build gets a limit well above a whole compile: what fails here is a wait."""
    import shutil

    from pdserve.engine.kernels import cpu_kernels

    ext = tmp_path / "ext"
    built = cpu_kernels.build_dir()
    d = ext / built.name
    d.mkdir(parents=True)
    if (built / f"{cpu_kernels.NAME}.so").exists():
        for f in built.iterdir():
            if f.suffix == ".o" or f.name in (".ninja_log", ".ninja_deps"):
                shutil.copy2(f, d / f.name)
    (d / "lock").write_text("")
    ok, why = _load_in_child(
        {"PDSERVE_EXT_DIR": str(ext), cpu_kernels.ENV_BUILD_TIMEOUT: "600"}, timeout=660
    )
    assert ok, why
    assert (d / f"{cpu_kernels.NAME}.so").exists() and not (d / "lock").exists()


def test_the_build_limit_is_read_from_the_environment(monkeypatch):
    from pdserve.engine.kernels import cpu_kernels

    for raw, want in (("", 180.0), ("600", 600.0), ("0", 180.0), ("nan", 180.0), ("x", 180.0)):
        monkeypatch.setenv(cpu_kernels.ENV_BUILD_TIMEOUT, raw)
        assert cpu_kernels.build_timeout_s() == want


def test_a_sliding_window_model_decodes_in_place_and_matches_hf(tmp_path, monkeypatch):
    """A tiny Gemma 3 (windows of 7 tokens on three of four layers): its decode groups attend with
    the kernel, told each sliding layer's window, and the logits match transformers'."""
    path = build_tiny_model(tmp_path / "gemma3", arch="gemma3", tie=True)
    cfg = load_model_config(path)
    rng = random.Random(1)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    ref = hf_logits(path, seqs)
    windows = []
    real = paged_attention.decode_attention

    def counted(*a):
        windows.append(a[5] if len(a) > 5 else 0)
        return real(*a)

    monkeypatch.setattr(paged_attention, "decode_attention", counted)
    slices = [load_slice(path, 0, 2), load_slice(path, 2, 4)]
    got = run_plan(slices, cfg, seqs, PLAN, one_group=True)
    assert all(s._in_place for s in slices)
    assert windows.count(cfg.sliding_window) == 3 * windows.count(0) > 0  # 3 of 4 layers slide
    assert max_err(got, ref) < 1e-4
