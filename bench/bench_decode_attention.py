"""bf16 decode attention over the paged pool (engine/kernels/csrc/paged_attention.cpp): the AVX-512
BF16 path (bf16 query) against the generic path on the same pool (the query in fp32: pages converted
to fp32 rows first), one process, alternating, on one core.

The case is SmolLM2's decode step at 32 requests of the workload's lengths: 30 layers, 9 query
heads on 3 KV heads of 64, pages of 16 tokens scattered over the pool. Also with every request
reading the same few pages (cache resident), which separates the arithmetic from the memory reads.

  .venv/bin/python bench/bench_decode_attention.py [--reps 7] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.kernels import paged_attention  # noqa: E402

LAYERS, PAGE, KV_HEADS, HEADS, D = 30, 16, 3, 9, 64


def case(
    seed: int = 0,
    lo: int = 70,
    hi: int = 530,
    dtype: torch.dtype = torch.bfloat16,
    requests: int = 32,
):
    """`requests` requests of lo..hi tokens: a page-major pool, their page tables (pages shuffled
    over the pool) and lengths."""
    rng = random.Random(seed)
    lens = [rng.randint(lo, hi) for _ in range(requests)]
    per = [-(-n // PAGE) for n in lens]
    pages = sum(per) + 8
    pool = torch.randn(pages, LAYERS, 2, PAGE, KV_HEADS, D).to(dtype)
    order = list(range(pages))
    rng.shuffle(order)
    tables, i = [], 0
    for k in per:
        tables.append(order[i : i + k] + [0] * (max(per) - k))
        i += k
    return pool, torch.tensor(tables), torch.tensor(lens)


def step_ms(q, pool, table, lens, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for layer in range(LAYERS):
            paged_attention.decode_attention(q, pool[:, layer], table, lens, D**-0.5)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode_attention_bf16.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not paged_attention.load():
        print("the kernel does not load:", paged_attention.why_not())
        return 1
    pool, table, lens = case()
    q = torch.randn(32, HEADS, D).bfloat16()
    resident = torch.tensor([[j % 34 for j in range(table.shape[1])] for _ in range(32)])
    rows = []
    for name, tab in (
        ("scattered pages (238 MB of KV)", table),
        ("34 pages, cache resident", resident),
    ):
        new, generic = [], []
        for _ in range(args.reps):  # alternating
            new += step_ms(q, pool, tab, lens, 1)
            generic += step_ms(q.float(), pool, tab, lens, 1)
        a, b = statistics.median(new), statistics.median(generic)
        rows.append(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
    kv_mb = int(lens.sum()) * LAYERS * KV_HEADS * D * 2 * 2 / 1e6
    text = "\n".join(
        [
            "# bf16 decode attention: AVX-512 BF16 path vs the generic one",
            "",
            f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"1 thread. 32 requests of 70-530 tokens ({int(lens.sum())} in all), {LAYERS} layers, "
            f"9 query heads on 3 KV heads of 64, pages of 16; {kv_mb:.0f} MB of KV per step. "
            f"Median of {args.reps}, alternating.",
            "",
            "| pool | bf16 path ms / step | generic ms / step | ratio |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            "Command: `.venv/bin/python bench/bench_decode_attention.py`",
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
