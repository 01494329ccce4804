"""The offline engine's decode step, timed, and two ways of running one timed alternating: shared by
bench_sampling.py and bench_decode_groups.py."""

from __future__ import annotations

import statistics
import time

from pdserve.engine import model_runner
from pdserve.engine.core import SamplingParams
from pdserve.engine.engine import Engine


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


def alternating_step_ms(
    eng: Engine,
    prompts: list[list[int]],
    params: SamplingParams,
    last: int,
    reps: int,
    attr: str,
    variants: dict,
) -> dict[str, list[float]]:
    """`median_step_ms` with `engine.model_runner.<attr>` set to each of `variants` (name ->
    object) in turn, `reps` rounds alternating, so a machine that slows down slows all of them;
    restores the attribute. Returns each variant's step times (ms), one per round."""
    real = getattr(model_runner, attr)
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(reps):
            for name, value in variants.items():
                setattr(model_runner, attr, value)
                times[name].append(median_step_ms(eng, prompts, params, last))
    finally:
        setattr(model_runner, attr, real)
    return times
