"""The last rank's sampling step: the sampler (engine/sampling.py: the inverse CDF, by the C++ op
and by its torch path) against torch.multinomial per row (the exponential race, what it did
before), one process, alternating, on one core.

Rows of SmolLM2's vocabulary (49,152) in bf16, as the forward leaves them, with an OpenAI client's
defaults (temperature 1, no top-k, top-p or min-p: what aiperf and vLLM's benchmarks send), and
greedy rows for scale.

  .venv/bin/python bench/bench_sampling.py [--rows 1,8,32,64] [--reps 7] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import cpu_kernels, sampling  # noqa: E402
from engine.core import SamplingParams  # noqa: E402
from engine.sampling import _filtered_probs, sample  # noqa: E402

VOCAB = 49_152


def multinomial_per_row(logits: torch.Tensor, params: list[SamplingParams], g) -> list[int]:
    """The sampler before: a filtered distribution and torch.multinomial for each row."""
    logits = logits.float()
    tokens = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        probs = _filtered_probs(logits[i], p)
        if bool(torch.isfinite(probs).all()) and float(probs.sum()) > 0.0:
            tokens[i] = torch.multinomial(probs, 1, generator=g)[0]
    return tokens.tolist()


def ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def table_row(rows: int, reps: int, g: torch.Generator) -> str:
    """One table row: the three samplers alternating `reps` times, then greedy rows."""
    torch.manual_seed(rows)
    logits = (torch.randn(rows, VOCAB) * 3).bfloat16()
    drawn = [SamplingParams(temperature=1.0)] * rows
    greedy = [SamplingParams()] * rows
    steps = [0] * rows
    old, op, py = [], [], []
    for _ in range(reps):
        old.append(ms(lambda: multinomial_per_row(logits, drawn, g), 1))
        sampling._kernel_on = True
        op.append(ms(lambda: sample(logits, drawn, steps, g), 1))
        sampling._kernel_on = False
        py.append(ms(lambda: sample(logits, drawn, steps, g), 1))
    sampling._kernel_on = True
    o, n, t = (statistics.median(x) for x in (old, op, py))
    gr = ms(lambda: sample(logits, greedy, steps, g), reps)
    return f"| {rows} | {o:.2f} | {n:.2f} | {n / o:.3f} | {t:.2f} | {t / o:.3f} | {gr:.2f} |"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    assert cpu_kernels.load(), cpu_kernels.why_not()
    g = torch.Generator()
    g.manual_seed(0)
    lines = [
        "# Sampling a decode step: inverse CDF against torch.multinomial per row",
        "",
        f"Machine: {platform.machine()}, torch {torch.__version__}, 1 thread. Rows of {VOCAB} bf16 "
        f"logits (seeded normal), temperature 1 and no filter; median of {args.reps}, the two "
        "samplers alternating.",
        "",
        "| rows | multinomial ms | inverse CDF, C++ op ms | ratio | inverse CDF, torch ms | ratio "
        "| greedy (C++ op) ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rows in (int(x) for x in args.rows.split(",")):
        lines.append(table_row(rows, args.reps, g))
        print(lines[-1], flush=True)
    lines += ["", "Command: `.venv/bin/python bench/bench_sampling.py`", ""]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
