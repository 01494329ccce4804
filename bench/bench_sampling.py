"""The last rank's sampling step: the sampler (engine/sampling.py: the inverse CDF, by the C++ op
and by its torch path) against torch.multinomial per row (the exponential race, what it did
before), one process, alternating, on one core.

Rows of SmolLM2's vocabulary (49,152) in bf16, as the forward leaves them, with an OpenAI client's
defaults (temperature 1, no top-k, top-p or min-p: what aiperf and vLLM's benchmarks send), and
greedy rows for scale. Then the whole decode step of the offline engine (SmolLM2-135M-Instruct,
bf16, one thread) at `--step-batch` requests of 70-534 token prompts at temperature 1, its last
rank's sampler swapped between the two, alternating runs of 48 output tokens: the median step over
each run's last 40 (all decode).

Then one filtered row (top-p, with top-k or min-p) for SmolLM2's and Gemma 3's vocabularies:
the whole vocabulary sorted against the candidates above a floor (`--filtered-only`: that alone).

  .venv/bin/python bench/bench_sampling.py [--rows 1,8,32,64] [--reps 7] [--step-batch 32]
      [--step-runs 2] [--filtered-only] [--out FILE.md]
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


def full_sort_filter(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """`_filtered_probs` with top-p by a (stable) sort of the whole vocabulary."""
    x = logits / p.temperature
    if p.top_k > 0:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    sorted_p, idx = torch.sort(probs, descending=True, stable=True)
    cum = torch.cumsum(sorted_p, dim=-1)
    sorted_p = sorted_p.masked_fill((cum - sorted_p) > p.top_p, 0.0)
    probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return probs / probs.sum()


def filtered_table(reps: int) -> list[str]:
    """One top-p row: the whole vocabulary sorted, against the candidates above a floor
    (engine/sampling.py `_nucleus`), for SmolLM2's and Gemma 3's vocabularies. A Zipf-like row
    (a language model's shape: the nucleus is a few hundred tokens) and a flat one (the nucleus is
    most of the vocabulary: every floor falls short, and the full sort serves after them)."""
    filters = {
        "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
        "top_k 40, top_p 0.95": SamplingParams(temperature=0.7, top_k=40, top_p=0.95),
        "min_p 0.05, top_p 0.9": SamplingParams(temperature=1.0, min_p=0.05, top_p=0.9),
    }
    lines = [
        "",
        f"One filtered row (fp32 logits), median of {reps}, the two alternating: ms per row.",
        "",
        "| vocabulary | row | filter | full sort ms | candidates ms | ratio |",
        "|---:|---|---|---:|---:|---:|",
    ]
    g = torch.Generator().manual_seed(5)
    for vocab in (VOCAB, 262_144):
        rank = torch.arange(1, vocab + 1, dtype=torch.float32)
        rows = {
            "Zipf-like": (-1.1 * rank.log() * 3)[torch.randperm(vocab, generator=g)],
            "flat": torch.randn(vocab, generator=g),
        }
        for row_name, row in rows.items():
            for name, p in filters.items():
                a, b = [], []
                for _ in range(reps):
                    a.append(ms(lambda row=row, p=p: full_sort_filter(row, p), 1))
                    b.append(ms(lambda row=row, p=p: _filtered_probs(row, p), 1))
                full, cand = statistics.median(a), statistics.median(b)
                lines.append(
                    f"| {vocab} | {row_name} | {name} | {full:.2f} | {cand:.2f} | "
                    f"{cand / full:.3f} |"
                )
                print(lines[-1], flush=True)
    return lines


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--step-batch", type=int, default=32)
    ap.add_argument("--step-runs", type=int, default=2, help="0: no decode-step comparison")
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--filtered-only", action="store_true", help="only the top-p table (full sort or not)"
    )
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
    if args.filtered_only:
        lines = ["# Top-p without sorting the vocabulary", ""]
        lines.append(f"Machine: {platform.machine()}, torch {torch.__version__}, 1 thread.")
        lines += filtered_table(args.reps)
    else:
        for rows in (int(x) for x in args.rows.split(",")):
            lines.append(table_row(rows, args.reps, g))
            print(lines[-1], flush=True)
        lines += filtered_table(args.reps)
    if args.step_runs and not args.filtered_only:
        lines += step_table(args.step_batch, args.step_runs)
    flag = " --filtered-only" if args.filtered_only else ""
    lines += ["", f"Command: `.venv/bin/python bench/bench_sampling.py{flag}`", ""]
    text = "\n".join(lines)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
