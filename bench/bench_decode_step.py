"""Decode step time of the offline engine with and without packed block-code weights
(engine/kernels/packed_linear.py), SmolLM2-135M-Instruct, fp32 or bf16 (`--dtype`), in one process,
alternating.

Both engines load the same model; one with packed weights switched off (`EngineConfig(kernels=
KernelSwitches(packed_weights=False))`, a node's `--no-kernel-packed-weights`: its small batches
take the oneDNN-reordered copies), one with packed codes. For each batch size B: B seeded prompts
of 300-400 random token ids, then per engine and repetition the time of a run of S + 1 output
tokens minus that of a 1-token run (the prefix cache holds the prompts, so both runs prefill about
nothing), over S: the time of one decode step of B requests. Repetitions alternate the engines, so a
machine that slows down slows both.

  .venv/bin/python bench/bench_decode_step.py [--batches 1 8 32 64] [--steps 32] [--reps 3]
      [--threads 1] [--dtype float32] [--out bench/results/decode_step.md]
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
from pdserve.engine.kernels.switches import KernelSwitches  # noqa: E402


def engines(threads: int, dtype: str) -> dict[str, Engine]:
    out = {}
    for name, packed in (("reordered", False), ("packed", True)):
        # the switch decides at load which weights are packed: each engine keeps its own
        kernels = KernelSwitches(packed_weights=packed)
        cfg = EngineConfig(model=None, threads=threads, dtype=dtype, kernels=kernels)
        out[name] = Engine(cfg)
    return out


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(rng.randint(300, 400))]


def step_ms(eng: Engine, prompts: list[list[int]], steps: int) -> float:
    def run(n: int) -> float:
        t = time.perf_counter()
        eng.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    return (run(steps + 1) - run(1)) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(ROOT / "bench/results/decode_step.md"))
    args = ap.parse_args()
    os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[: args.threads]))
    engs = engines(args.threads, args.dtype)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    rows = []
    for b in args.batches:
        prompts = [prompt(rng) for _ in range(b)]
        times: dict[str, list[float]] = {k: [] for k in engs}
        for e in engs.values():  # prefill once: the prefix cache keeps the prompts
            e.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        for _ in range(args.reps):
            for name, e in engs.items():
                times[name].append(step_ms(e, prompts, args.steps))
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((b, times, med["packed"] / med["reordered"]))
        print(f"B={b}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()), flush=True)
    lines = [
        "# Decode step, packed block codes vs oneDNN-reordered weights",
        "",
        f"`bench/bench_decode_step.py`, {platform.processor() or platform.machine()}, "
        f"{args.threads} thread(s), torch {torch.__version__}, SmolLM2-135M-Instruct {args.dtype}, "
        f"prompts "
        f"300-400 tokens, {args.steps} steps, {args.reps} alternating repetitions (median).",
        "",
        "| batch | reordered, ms/step | packed, ms/step | packed / reordered |",
        "|---:|---|---|---:|",
    ]
    for b, times, ratio in rows:
        cells = [" ".join(f"{x:.1f}" for x in times[k]) for k in ("reordered", "packed")]
        lines.append(f"| {b} | {cells[0]} | {cells[1]} | {ratio:.2f}x |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
