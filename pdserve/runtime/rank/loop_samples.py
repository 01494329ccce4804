"""A rank loop's latency samples for the front's histograms (runtime/front/metrics.py): how long
each request waited in the scheduler's queue and ran. PP0 only, and metrics only: the wall clock
read here never reaches a decision."""

from __future__ import annotations

import time

from pdserve.engine.batch import ScheduledBatch
from pdserve.engine.core import Req


class LoopSamples:
    """Mixed into the slot loop (runtime/rank/slot_loop.py), which says whether it `is_first`."""

    # sent (empty) with every push: the front's histograms exist from the first scrape
    sample_names: tuple[str, ...] = ("queue:waiting", "queue:running")

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}  # since the last push, by name
        self._t_queued: dict[str, float] = {}  # rid -> entered the scheduler's waiting queue
        self._t_running: dict[str, float] = {}  # rid -> first scheduled

    @property
    def is_first(self) -> bool:
        """Whether this is PP0, the one rank that keeps samples (the slot loop says)."""
        raise NotImplementedError

    def observe(self, name: str, seconds: float) -> None:
        """Records a latency sample for the front's histograms (PP0 only, metrics only)."""
        if self.is_first:
            self.samples.setdefault(name, []).append(seconds)

    def mark_queued(self, rid: str) -> None:
        if self.is_first:
            self._t_queued[rid] = time.monotonic()

    def drain_samples(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {n: [] for n in self.sample_names}
        out.update(self.samples)
        self.samples = {}
        return out

    def time_admissions(self, batch: ScheduledBatch) -> None:
        """The queue wait of each request `batch` schedules for the first time."""
        if not self._t_queued:
            return
        now = time.monotonic()
        for e in batch.entries:
            t0 = self._t_queued.pop(e.req.rid, None)
            if t0 is not None:
                self.observe("queue:waiting", now - t0)
                self._t_running[e.req.rid] = now

    def time_finish(self, req: Req) -> None:
        """The running time of a request that finished."""
        self._t_queued.pop(req.rid, None)
        t0 = self._t_running.pop(req.rid, None)
        if t0 is not None:
            self.observe("queue:running", time.monotonic() - t0)
