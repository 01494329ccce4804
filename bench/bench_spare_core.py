"""Prefill time of the offline engine with and without the spare-core helper
(engine/kernels/spare_core.py), SmolLM2-135M-Instruct, fp32, one compute thread, in one process.

The engine computes on the first core of this process; the helper may run on the second, at nice
19. For each prompt length: the time of a 1-token generate (the prefill, prefix cache off), helper
on and off alternating, median of `--reps`; once with the second core idle, once with a busy
process on it (a spinning Python at nice 0, standing in for the client and the fronts under load).

  .venv/bin/python bench/bench_spare_core.py [--lengths 128 300 534 1024 2000] [--reps 5]
      [--out bench/results/spare_core.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import subprocess
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
from pdserve.engine.kernels import spare_core  # noqa: E402


def prefill_ms(eng: Engine, n: int, rng: random.Random) -> float:
    ids = [rng.randrange(100, 49000) for _ in range(n)]
    t = time.perf_counter()
    eng.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))
    return (time.perf_counter() - t) * 1e3


def measure(eng: Engine, lengths: list[int], reps: int, cores: tuple[int, ...]) -> list[tuple]:
    rng = random.Random(0)
    rows = []
    for n in lengths:
        t: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(reps):
            for mode in ("off", "on"):
                spare_core._cores = cores if mode == "on" else ()
                t[mode].append(prefill_ms(eng, n, rng))
        rows.append((n, statistics.median(t["off"]), statistics.median(t["on"])))
    spare_core._cores = cores
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 300, 534, 1024, 2000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/spare_core.md"))
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("needs two cores")
    main_core, spare = cpus[0], (cpus[1],)
    os.sched_setaffinity(0, {main_core})
    eng = Engine(
        EngineConfig(
            model=None,
            threads=1,
            dtype="float32",
            enable_prefix_cache=False,
            max_batch_tokens=2048,
            spare_cores=spare,
        )
    )
    prefill_ms(eng, 64, random.Random(1))  # warm up
    results = {"idle": measure(eng, args.lengths, args.reps, spare)}
    busy = subprocess.Popen(
        ["taskset", "-c", str(spare[0]), sys.executable, "-c", "while True: pass"]
    )
    try:
        time.sleep(0.5)
        results["busy"] = measure(eng, args.lengths, args.reps, spare)
    finally:
        busy.kill()
        busy.wait()
    counts = spare_core.counts()
    lines = [
        "# Prefill with a helper on the spare core (engine/kernels/spare_core.py)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"the engine on core {main_core}, the helper on core {spare[0]} at nice "
        f"{spare_core.NICE}, fp32, median of {args.reps} alternating. Blocks over the run: "
        f"{counts['rank']} by the rank's thread, {counts['helper']} by the helper, "
        f"{counts['taken_back']} taken back from it.",
        "",
        "| spare core | prompt tokens | helper off ms | helper on ms | on / off |",
        "|---|---:|---:|---:|---:|",
    ]
    for cond, rows in results.items():
        for n, off, on in rows:
            lines.append(f"| {cond} | {n} | {off:.0f} | {on:.0f} | {on / off:.2f} |")
    lines += ["", "Command: `.venv/bin/python bench/bench_spare_core.py`", ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
