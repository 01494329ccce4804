"""The last rank's sampling step: the sampler (engine/sampling.py: the inverse CDF, by the C++ op
and by its torch path) against torch.multinomial per row (the exponential race, what it did
before), one process, alternating, on one core.

Rows of SmolLM2's vocabulary (49,152) in bf16, as the forward leaves them, with an OpenAI client's
defaults (temperature 1, no top-k, top-p or min-p: what aiperf and vLLM's benchmarks send), and
greedy rows for scale. Then the whole decode step of the offline engine (SmolLM2-135M-Instruct,
bf16, one thread) at `--step-batch` requests of 70-534 token prompts at temperature 1, its last
rank's sampler swapped between the two, alternating runs of 48 output tokens: the median step over
each run's last 40 (all decode).

  .venv/bin/python bench/bench_sampling.py [--rows 1,8,32,64] [--reps 7] [--step-batch 32]
      [--step-runs 2] [--out FILE.md]
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("TQDM_DISABLE", "1")
from engine_steps import alternating_step_ms  # noqa: E402

from pdserve.engine import model_runner, sampling  # noqa: E402
from pdserve.engine.batch import SampleOut  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.core import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.kernels import cpu_kernels  # noqa: E402
from pdserve.engine.sampling import _filtered_probs, sample  # noqa: E402

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


def step_table(batch: int, runs: int) -> list[str]:
    """The engine's decode step with each sampler, alternating `runs` times."""
    eng = Engine(EngineConfig(model=None, threads=1, dtype="bfloat16"))
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40_000) for _ in range(rng.randint(70, 534))] for _ in range(batch)
    ]
    eng.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    old = lambda logits, params, steps, g, *rest: SampleOut(multinomial_per_row(logits, params, g))  # noqa: E731
    sp = SamplingParams(max_tokens=48, ignore_eos=True, temperature=1.0)
    variants = {"multinomial": old, "inverse CDF": model_runner.sample}
    times = alternating_step_ms(eng, prompts, sp, 40, runs, "sample", variants)
    o, n = (statistics.median(v) for v in times.values())
    return [
        "",
        f"Offline engine, bf16, 1 thread, {batch} requests at temperature 1: median decode step "
        f"(ms) per run, {runs} alternating runs of each.",
        "",
        "| sampler | decode step ms, each run | median | ratio |",
        "|---|---|---:|---:|",
        f"| torch.multinomial per row | {' / '.join(f'{x:.1f}' for x in times['multinomial'])} "
        f"| {o:.1f} | 1 |",
        f"| inverse CDF (C++ op) | {' / '.join(f'{x:.1f}' for x in times['inverse CDF'])} "
        f"| {n:.1f} | {n / o:.3f} |",
    ]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--step-batch", type=int, default=32)
    ap.add_argument("--step-runs", type=int, default=2, help="0: no decode-step comparison")
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
    if args.step_runs:
        lines += step_table(args.step_batch, args.step_runs)
    lines += ["", "Command: `.venv/bin/python bench/bench_sampling.py`", ""]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
