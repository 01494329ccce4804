"""Prefill (extend) attention: the in-place kernel (engine/kernels/csrc/extend_attention.cpp)
against the gather path it replaces (the item's pages gathered, then SDPA: is_causal from position
0, an additive mask over a cached prefix), in bf16 on one thread, alternating in one process.

1. One layer of SmolLM2's attention (9 query heads, 3 KV heads, 64 dims, 16-token pages) for one
   item: cached prefix and new tokens as given. GFLOP/s counts the useful work (4 x heads x dims per
   query-key pair the causal mask keeps).
2. The default model's whole prefill of one request (all layers, matmuls included), the kernel on
   and off (`one_extend_group`).

    .venv/bin/python bench/bench_extend_attention.py --out bench/results/extend_attention.md
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.engine.forward_batch import BatchItem, build_forward_batch
from pdserve.engine.kernels import paged_attention
from pdserve.engine.kv_cache import KVLayout, KVPool
from pdserve.engine.model.loader import load_model_config, load_slice, resolve_model

NH, NKV, D, PAGE = 9, 3, 64, 16
CASES = [(0, 100), (0, 300), (0, 500), (512, 100), (512, 300), (900, 64)]


def layer_case(start: int, new: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_keys = start + new
    pages = -(-n_keys // PAGE)
    kv = torch.randn(pages + 4, 2, PAGE, NKV, D, generator=g).to(torch.bfloat16)
    table = torch.randperm(pages + 4, generator=g)[:pages]
    q = torch.randn(new, NH * D + 2 * NKV * D, generator=g).to(torch.bfloat16)
    return q[:, : NH * D].view(new, NH, D), kv, table


def gathered(q, kv, table, start):
    """What the model's gather path does for one extend item."""
    new, n_keys = q.shape[0], start + q.shape[0]
    keys = kv[:, 0].index_select(0, table).view(1, -1, NKV, D)[:, :n_keys].transpose(1, 2)
    vals = kv[:, 1].index_select(0, table).view(1, -1, NKV, D)[:, :n_keys].transpose(1, 2)
    qg = q.reshape(1, new, NH, D).transpose(1, 2)
    if start == 0:
        return F.scaled_dot_product_attention(qg, keys, vals, is_causal=True, enable_gqa=True)
    ok = torch.arange(n_keys)[None, :] <= start + torch.arange(new)[:, None]
    mask = torch.zeros(new, n_keys, dtype=q.dtype).masked_fill_(~ok, float("-inf"))
    return F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, enable_gqa=True)


def in_place(q, kv, table, start):
    out = torch.empty(q.shape, dtype=q.dtype)
    n = torch.tensor([q.shape[0]])
    paged_attention.extend_attention_(
        out, q, kv, table[None], n + start, n, torch.tensor([0]), D**-0.5
    )
    return out


def alternate(fns, reps: int, inner: int) -> list[float]:
    """Best-of-`reps` seconds per call of each fn, the fns taking turns."""
    best = [float("inf")] * len(fns)
    for f in fns:
        f()
    for _ in range(reps):
        for i, f in enumerate(fns):
            t = time.perf_counter()
            for _ in range(inner):
                f()
            best[i] = min(best[i], (time.perf_counter() - t) / inner)
    return best


def bench_layer(reps: int) -> list[str]:
    rows = [
        "| cached | new | gather + SDPA ms | GFLOP/s | in place ms | GFLOP/s | in place / gather |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for start, new in CASES:
        q, kv, table = layer_case(start, new)
        ref, got = gathered(q, kv, table, start), in_place(q, kv, table, start)
        err = (got.float() - ref[0].transpose(0, 1).float()).abs().max().item()
        assert err < 0.05, f"the kernel and SDPA differ by {err}"
        args = (q, kv, table, start)
        g, k = alternate([partial(gathered, *args), partial(in_place, *args)], reps, 10)
        flop = (start * new + new * (new + 1) / 2) * NH * D * 4
        rows.append(
            f"| {start} | {new} | {g * 1e3:.2f} | {flop / g / 1e9:.0f} | {k * 1e3:.2f} | "
            f"{flop / k / 1e9:.0f} | {k / g:.2f}x |"
        )
        print(rows[-1], flush=True)
    return rows


def bench_model(reps: int) -> list[str]:
    path = resolve_model(None)
    cfg = load_model_config(path)
    s = load_slice(path, 0, cfg.num_layers, dtype=torch.bfloat16)
    lay = KVLayout(128, PAGE, 0, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    pool = KVPool(lay)
    assert s.choose_extend_attention(pool), "the extend kernel is off here"
    pages = list(range(128))

    def prefill(start: int, new: int, kernel: bool):
        item = BatchItem(pages, start, new, True)
        fb = build_forward_batch([item], PAGE, one_decode_group=True, one_extend_group=kernel)
        ids = torch.randint(0, cfg.vocab_size, (new,), generator=torch.Generator().manual_seed(1))
        s(ids, fb, pool)

    rows = [
        "| cached | new | gather + SDPA ms | in place ms | in place / gather |",
        "|---:|---:|---:|---:|---:|",
    ]
    for start, new in CASES[:5]:
        if start:
            prefill(0, start, True)  # the cached prefix's keys and values in the pool
        runs = [partial(prefill, start, new, False), partial(prefill, start, new, True)]
        g, k = alternate(runs, reps, 1)
        rows.append(f"| {start} | {new} | {g * 1e3:.0f} | {k * 1e3:.0f} | {k / g:.2f}x |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    why = paged_attention.extend_why_not(NH // NKV, D, PAGE)
    if why:
        sys.exit(f"the extend kernel is off here: {why}")
    load = os.getloadavg()
    layer = bench_layer(args.reps)
    model = bench_model(max(2, args.reps - 2))
    text = "\n".join(
        [
            "# Prefill attention in place against gather + SDPA (bf16, one thread)",
            "",
            f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), torch {torch.__version__}; "
            f"load average at start {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}. Best of "
            f"{args.reps} alternating rounds.",
            "",
            "## One layer of SmolLM2's attention, one item",
            "",
            *layer,
            "",
            "## SmolLM2-135M's whole prefill of one request (matmuls included)",
            "",
            *model,
            "",
            f"Command: `.venv/bin/python bench/bench_extend_attention.py --reps {args.reps}`",
            "",
        ]
    )
    if args.out:
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
