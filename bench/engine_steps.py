"""The offline engine's decode step, timed: shared by the benches that compare two ways of running
one (bench_sampling.py, bench_decode_groups.py)."""

from __future__ import annotations

import statistics
import time

from engine.core import SamplingParams
from engine.engine import Engine


def median_step_ms(
    eng: Engine, prompts: list[list[int]], params: SamplingParams, last: int
) -> float:
    """Adds `prompts` with `params`, steps the engine until they finish, and returns the median of
    the last `last` steps in ms (choose `last` below `params.max_tokens`: all decode steps)."""
    for p in prompts:
        eng.add_request(p, params)
    steps = []
    while eng.scheduler.has_work:
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    eng._done = {}  # finished requests that generate() would have returned; nobody collects them
    return statistics.median(steps[-last:]) * 1e3
