"""Decode step of the offline engine with the in-place attention kernel called once per layer
for all decode requests (one group in item order; an all-decode batch hands the kernel the fused
QKV rows as they lie and takes its output as the layer's) against groups of DECODE_GROUP_SIZE
sorted by length (what the gather path needs, and what the kernel was fed before), in one
process, alternating.

SmolLM2-135M-Instruct, bf16, one thread. For each batch size B: B seeded prompts of 300-400
random token ids, then runs of 40 output tokens; a run's time is the median of its last 32 steps
(all decode).

  .venv/bin/python bench/bench_decode_groups.py [--batches 8 32 64] [--reps 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine_steps import alternating_step_ms, median_step_ms  # noqa: E402

from pdserve.engine import forward_batch  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.core import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402

ONE_GROUP = forward_batch.build_forward_batch


def sorted_groups(items, page_size, device="cpu", one_decode_group=False):
    return ONE_GROUP(items, page_size, device)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    eng = Engine(EngineConfig(model=None, threads=1, dtype="bfloat16"))
    torch.set_num_threads(1)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    lines = [
        "# Decode step: the in-place kernel once per layer vs per sorted group of 8",
        "",
        f"`bench/bench_decode_groups.py`, {platform.machine()}, 1 thread, torch "
        f"{torch.__version__}, SmolLM2-135M-Instruct bf16, prompts 300-400 tokens, median of the "
        f"last 32 of 40 steps, {args.reps} alternating runs each.",
        "",
        "| batch | groups of 8, ms/step | one group, ms/step | one / groups |",
        "|---:|---|---|---:|",
    ]
    print("\n".join(lines), flush=True)
    for b in args.batches:
        rng = random.Random(b)
        prompts = [
            [rng.randrange(100, 40_000) for _ in range(rng.randint(300, 400))] for _ in range(b)
        ]
        median_step_ms(
            eng, prompts, sp, last=32
        )  # warm-up (and the prefix cache holds the prompts after it)
        variants = {"groups": sorted_groups, "one": ONE_GROUP}
        times = alternating_step_ms(
            eng, prompts, sp, 32, args.reps, "build_forward_batch", variants
        )
        g, o = (statistics.median(v) for v in times.values())
        fmt = lambda v: " ".join(f"{x:.1f}" for x in v)  # noqa: E731
        lines.append(f"| {b} | {fmt(times['groups'])} | {fmt(times['one'])} | {o / g:.2f}x |")
        print(lines[-1], flush=True)
    lines += ["", "Command: `.venv/bin/python bench/bench_decode_groups.py`", ""]
    if args.out:
        Path(args.out).write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
