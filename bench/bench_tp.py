"""Tensor parallelism against pipeline parallelism against neither, on one colocated node
(docs/ARCHITECTURE.md section 15): SmolLM2-135M-Instruct at its own dtype, `pdserve serve` as a
process, each layout in turn, the same requests, all in one run.

Layouts: `--pp 1 --threads 2` (one process, both cores), `--pp 3 --threads 1` and
`--tp 3 --threads 1` (three processes, one thread each). SmolLM2's 9 query heads and 3 KV heads
take TP 3, not 2; on a 2-core machine both 3-process layouts put 3 busy processes on 2 cores.
Requests: seeded random token ids of 100-250 tokens, `--max-tokens` output tokens with ignore_eos,
through POST /generate with `stream: true`, `--concurrency` levels in turn; output tok/s, TTFT
p50/p99 and ITL p50/p99 (over every gap between two tokens of a stream), as ratios to the
one-process layout of the same round.

  .venv/bin/python bench/bench_tp.py [--rounds 2] [--requests 32] [--concurrency 8,32]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402

LAYOUTS = {
    "neither (1 process x 2 threads)": ["--pp", "1", "--threads", "2"],
    "PP 3 (3 x 1)": ["--pp", "3", "--threads", "1"],
    "TP 3 (3 x 1)": ["--tp", "3", "--threads", "1"],
}


def gaps(lvl: loadgen.LevelResult) -> list[float]:
    return sorted(b - a for r in lvl.ok for a, b in zip(r.times, r.times[1:], strict=False))


def pct(v: list[float], q: float) -> float:
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def measure(url: str, prompts, max_new: int, levels: list[int], label) -> dict:
    """Warms `url` up, then each concurrency level of streamed /generate requests in turn: output
    tok/s, TTFT p50/p99, ITL p50/p99 and errors, by level."""
    out = {}

    async def send(c, ids, t0, res):
        body = {"input_ids": ids, "sampling_params": {"max_tokens": max_new, "ignore_eos": True}}
        await loadgen.stream_generate(c, url, body, t0, res)

    asyncio.run(loadgen.run_level(loadgen.make_prompts(2, seed=999), 8, 2, send))  # warm-up
    for c in levels:
        results, wall = asyncio.run(loadgen.run_level(prompts, max_new, c, send))
        lvl = loadgen.LevelResult(c, results, wall)
        g = gaps(lvl)
        out[c] = {
            "tok_s": lvl.out_tokens / wall,
            "ttft50": lvl.stat("ttft", 0.5),
            "ttft99": lvl.stat("ttft", 0.99),
            "itl50": pct(g, 0.5),
            "itl99": pct(g, 0.99),
            "errors": lvl.errors,
        }
        print(label, c, out[c], flush=True)
    return out


def ratio_rows(rnd: int, got: dict, levels: list[int], with_rate: bool = True) -> list[str]:
    """Table rows of round `rnd`: each layout's figures as ratios to the first layout's
    (`with_rate`: the output rate itself too)."""
    base = next(iter(got.values()))
    rows = []
    for name, res in got.items():
        for c in levels:
            m, b = res[c], base[c]
            rate = f"{m['tok_s'] / b['tok_s']:.2f}x"
            if with_rate:
                rate = f"{m['tok_s']:.1f} ({rate})"
            rows.append(
                f"| {rnd} | {name} | {c} | {rate} | "
                f"{m['ttft50'] / b['ttft50']:.2f}x | {m['ttft99'] / b['ttft99']:.2f}x | "
                f"{m['itl50'] / b['itl50']:.2f}x | {m['itl99'] / b['itl99']:.2f}x | "
                f"{m['errors']} |"
            )
    return rows


def run_layout(flags: list[str], prompts, max_new: int, levels: list[int], log: Path) -> dict:
    port = loadgen.free_port()
    with loadgen.start(["serve", *flags, "--port", str(port)], port, log, timeout=420) as (url, _):
        return measure(url, prompts, max_new, levels, flags)


def compare_layouts(
    layouts: dict[str, list[str]],
    run_layout,
    defaults: dict,
    title: str,
    setup: str,
    with_rate: bool = True,
) -> int:
    """Each layout in turn, `--rounds` times, the same requests: the rows (ratios to the first
    layout of the same round and level) written to `--out` after each round. `setup` says what is
    served (between the machine line and the requests); `defaults`: rounds, concurrency, out."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=defaults["rounds"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", default=defaults["concurrency"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=defaults["out"])
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    prompts = loadgen.make_prompts(args.requests, seed=1)
    logdir = Path(tempfile.mkdtemp(prefix="bench_layouts_"))
    first = next(iter(layouts))
    lines = [
        f"# {title}",
        "",
        f"Machine: {os.cpu_count()} CPUs ({platform.machine()}, {platform.processor() or '?'}), "
        f"Python {platform.python_version()}; load average at start: {loadgen.loadavg()}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}. {setup}; {args.requests} requests of 100-250 random "
        f"token ids, {args.max_tokens} output tokens, ignore_eos; concurrency {args.concurrency}; "
        f"{args.rounds} round(s), the layouts in turn in each. Ratios are to {first} of the same "
        f"round and level. Logs: {logdir}.",
        "",
        "| round | layout | concurrency | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
        "| errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rnd in range(1, args.rounds + 1):
        got = {}
        for i, (name, flags) in enumerate(layouts.items()):
            got[name] = run_layout(
                flags, prompts, args.max_tokens, levels, logdir / f"r{rnd}_{i}.log"
            )
        lines += ratio_rows(rnd, got, levels, with_rate=with_rate)
        Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    return compare_layouts(
        LAYOUTS,
        run_layout,
        {"rounds": 2, "concurrency": "8,32", "out": str(ROOT / "bench/results/tp.md")},
        "Tensor parallelism vs pipeline parallelism vs neither (one colocated node)",
        "SmolLM2-135M-Instruct at its own dtype (bf16)",
    )


if __name__ == "__main__":
    sys.exit(main())
