"""A bf16 decode step of Gemma 3 270M (the whole model in one slice, one thread): its sliding
layers' attention by gathering pages and SDPA with window masks, against the in-place decode
kernel told the window (engine/kernels/csrc/paged_attention.cpp), alternating; the same for one
prompt's prefill against the extend kernel (engine/kernels/csrc/extend_attention.cpp; measured on
any CPU with AVX-512 BF16, though the engine takes it for head size 256 only without AMX); and
the LM head over the 262k vocabulary alone, for scale.

  .venv/bin/python bench/bench_gemma3_decode.py [--batch 32] [--context 300,700] [--reps 5]
      [--out FILE.md]

The model is `--model gemma3-270m`'s GGUF (engine/model/path.py assembles it on first use).
Contexts past 512 tokens are cut by the window on 15 of the 18 layers.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.forward_batch import BatchItem, build_forward_batch  # noqa: E402
from pdserve.engine.kernels import paged_attention  # noqa: E402
from pdserve.engine.kv_cache import KVLayout, KVPool  # noqa: E402
from pdserve.engine.model.linear import linear  # noqa: E402
from pdserve.engine.model.loader import load_slice  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from bench_sampling import ms as median_ms  # noqa: E402  (median ms of calls, after one untimed)

PAGE = 16


def step_ms(s, pool, items, in_place: bool, reps: int) -> float:
    """Median ms of a decode step of `items` (attention in place or gathered)."""
    s._in_place = in_place
    fb = build_forward_batch(items, PAGE, one_decode_group=in_place, window=s.window)
    x = torch.randint(0, 1000, (len(items),))
    return median_ms(lambda: s(x, fb, pool), reps)


def prefill_ms(s, prompt: int, in_place: bool, reps: int) -> float:
    """Median ms of one prompt's prefill in one forward (attention in place or gathered)."""
    pages = -(-prompt // PAGE)
    pool = KVPool(KVLayout(pages + 1, PAGE, 0, 18, 1, 256, torch.bfloat16))
    s._extend_in_place = in_place
    item = BatchItem(list(range(pages)), 0, prompt, True)
    fb = build_forward_batch([item], PAGE, one_extend_group=in_place, window=s.window)
    x = torch.randint(0, 1000, (prompt,))
    return median_ms(lambda: s(x, fb, pool), reps)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", default="300,700")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    s = load_slice("gemma3-270m", 0, 18, dtype=torch.bfloat16)
    s.add_small_batch_weights()
    assert s.choose_decode_attention(KVPool(KVLayout(1, PAGE, 0, 18, 1, 256, torch.bfloat16)))
    lines = [
        "# Gemma 3 270M: a bf16 decode step, attention gathered or in place",
        "",
        f"Machine: {platform.machine()}, torch {torch.__version__}, 1 thread; {args.batch} "
        f"requests, pages of {PAGE}; median of {args.reps} steps, the two alternating per context.",
        "",
        "| context | gathered + SDPA ms | in-place kernel ms | ratio |",
        "|---:|---:|---:|---:|",
    ]
    for ctx in (int(c) for c in args.context.split(",")):
        pages = -(-(ctx + 1) // PAGE)
        pool = KVPool(KVLayout(args.batch * pages + 1, PAGE, 0, 18, 1, 256, torch.bfloat16))
        pool.kv.normal_()
        items = [
            BatchItem(list(range(b * pages, (b + 1) * pages)), ctx, 1, True)
            for b in range(args.batch)
        ]
        gathered, in_place = [], []
        for _ in range(2):
            gathered.append(step_ms(s, pool, items, False, args.reps))
            in_place.append(step_ms(s, pool, items, True, args.reps))
        g, k = statistics.median(gathered), statistics.median(in_place)
        lines.append(f"| {ctx} | {g:.1f} | {k:.1f} | {k / g:.3f} |")
        print(lines[-1], flush=True)
    kernel = paged_attention.load() and torch.ops.pdserve.extend_attention_supports(4, 256, PAGE)
    if kernel:
        lines += [
            "",
            "One prompt's prefill in one forward:",
            "",
            "| prompt tokens | gathered + SDPA ms | extend kernel ms | ratio |",
            "|---:|---:|---:|---:|",
        ]
        for prompt in (300, 1500):
            gathered, in_place = [], []
            for _ in range(2):
                gathered.append(prefill_ms(s, prompt, False, args.reps))
                in_place.append(prefill_ms(s, prompt, True, args.reps))
            g, k = statistics.median(gathered), statistics.median(in_place)
            lines.append(f"| {prompt} | {g:.1f} | {k:.1f} | {k / g:.3f} |")
            print(lines[-1], flush=True)
    h = torch.randn(args.batch, 640, dtype=torch.bfloat16)
    head = median_ms(lambda: linear(h, s.lm_head_weight, s._small_head), args.reps)
    lines += [
        "",
        f"The LM head alone (640 x 262,144, {args.batch} rows): {head:.1f} ms.",
        "",
        "Command: `.venv/bin/python bench/bench_gemma3_decode.py`",
        "",
    ]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
