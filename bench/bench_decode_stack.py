"""The offline engine's decode step with the layer stack in one C++ call
(engine/kernels/decode_stack.py) and with the Python layer loop, one process, alternating, on one
core.

SmolLM2-135M-Instruct in bf16, one thread pinned to core 0 (`--core`), prefix cache off. For each
batch size B: B prompts of 300-400 random tokens at temperature 1, 48 output tokens; the median
step over each run's last 40 (all decode), the call on and off by turns (the slice's stack
weights set and cleared), so a machine that slows down slows both.

  .venv/bin/python bench/bench_decode_stack.py [--batches 1 8 32] [--reps 3] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("TQDM_DISABLE", "1")
from engine_steps import median_step_ms  # noqa: E402

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.core import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.kernels import decode_stack  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.sched_setaffinity(0, {a.core})
    eng = Engine(EngineConfig(model=None, threads=1, dtype="bfloat16", enable_prefix_cache=False))
    model = eng.runner.model
    stack = model._stack
    if stack is None:
        sys.exit(f"the decode stack is off here: {decode_stack.why_not(model)}")
    params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=1.0, seed=0)
    variants = {"one call": stack, "layer loop": None}
    rows = []
    for b in a.batches:
        rng = random.Random(b)
        prompts = [
            [rng.randrange(100, 49000) for _ in range(rng.randint(300, 400))] for _ in range(b)
        ]
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(a.reps):
            for name, value in variants.items():
                model._stack = value
                times[name].append(median_step_ms(eng, prompts, params, 40))
        model._stack = stack
        on, off = (statistics.median(times[k]) for k in variants)
        rows.append((b, times["one call"], times["layer loop"], on / off))
        print(f"B={b}: one call {on:.2f} ms, layer loop {off:.2f} ms, {on / off:.2f}x", flush=True)
    lines = [
        "# Decode step: the layer stack in one call against the Python layer loop",
        "",
        f"`bench/bench_decode_stack.py`, {platform.machine()}, 1 thread on core {a.core}, "
        f"torch {torch.__version__}, SmolLM2-135M-Instruct bf16, prompts of 300-400 tokens, "
        f"median of each run's last 40 steps, {a.reps} alternating runs.",
        "",
        "| requests | one call, ms/step | layer loop, ms/step | one call / loop (medians) |",
        "|---:|---|---|---:|",
    ]
    for b, on, off, ratio in rows:
        fmt = " ".join(f"{t:.1f}" for t in on), " ".join(f"{t:.1f}" for t in off)
        lines.append(f"| {b} | {fmt[0]} | {fmt[1]} | {ratio:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
