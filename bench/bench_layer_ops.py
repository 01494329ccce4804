"""Decode step and prefill time of the offline engine with the fused per-layer ops
(engine/kernels/layer_ops.py: RMSNorm, SiLU * up, rotary + KV store) on and off,
SmolLM2-135M-Instruct, fp32, one process, one core.

The ops are switched per repetition inside one engine (off, on, off, on, ...), so a machine that
slows down slows both. Decode: B seeded prompts of 300-400 random token ids, the time of S + 1
output tokens minus that of 1 token (the prefix cache holds the prompts), over S. Prefill: P fresh
prompts of 350 tokens, one output token (new ids each time: nothing cached). Reports the median of
the per-pair on / off ratios.

  .venv/bin/python bench/bench_layer_ops.py [--batches 1 8 32] [--steps 16] [--pairs 7]
      [--out bench/results/layer_ops.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.core import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.kernels import layer_ops  # noqa: E402


def timed(eng: Engine, prompts: list[list[int]], n: int) -> float:
    t = time.perf_counter()
    eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
    return time.perf_counter() - t


def pairs(measure, n: int) -> tuple[list[float], list[float]]:
    """n alternating (off, on) measurements of `measure()` (seconds)."""
    off, on = [], []
    for _ in range(n):
        for mode, out in ((False, off), (True, on)):
            layer_ops._on = mode  # the process-wide switch that load() sets
            out.append(measure())
    return off, on


def row(name: str, off: list[float], on: list[float], unit: float) -> str:
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    return (
        f"| {name} | {statistics.median(off) * unit:.1f} | {statistics.median(on) * unit:.1f} | "
        f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--pairs", type=int, default=7)
    ap.add_argument("--prefill-prompts", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench/results/layer_ops.md"))
    args = ap.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    eng = Engine(EngineConfig(model=None, threads=1, dtype="float32"))
    torch.set_num_threads(1)
    if not layer_ops.load():
        sys.exit(f"the layer ops are off: {layer_ops.cpu_kernels.why_not()}")
    rng = random.Random(0)
    rows = []
    for b in args.batches:
        prompts = [
            [rng.randrange(100, 49000) for _ in range(rng.randint(300, 400))] for _ in range(b)
        ]
        timed(eng, prompts, 2)  # prefill once: the prefix cache keeps them

        def step(prompts=prompts) -> float:
            return (timed(eng, prompts, args.steps + 1) - timed(eng, prompts, 1)) / args.steps

        off, on = pairs(step, args.pairs)
        rows.append(row(f"decode step, {b} requests (ms)", off, on, 1e3))
        print(rows[-1], flush=True)
    n = args.prefill_prompts

    def fresh() -> float:
        return timed(eng, [[rng.randrange(100, 49000) for _ in range(350)] for _ in range(n)], 1)

    off, on = pairs(fresh, args.pairs)
    rows.append(row(f"prefill, {n} prompts of 350 tokens (s)", off, on, 1.0))
    print(rows[-1], flush=True)
    lines = [
        "# Fused per-layer ops on / off",
        "",
        f"`bench/bench_layer_ops.py`, {platform.processor() or platform.machine()}, one core, "
        f"torch {torch.__version__}, SmolLM2-135M-Instruct fp32, {args.pairs} alternating pairs "
        "in one process (median; the range of the per-pair ratios in brackets).",
        "",
        "| measure | off | on | on / off |",
        "|---|---:|---:|---:|",
        *rows,
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
