"""A rank loop as its process sees it: apart from SlotLoop, as an elastic node's loop is none."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.engine.scheduler import Scheduler
from pdserve.runtime.messages import Event, StatsExtension
from pdserve.runtime.rank.spans import RankSpans


class FrontIO(Protocol):
    """PP0's seam to the front (ZMQ in a node, in-memory in tests)."""

    def poll(self, timeout_ms: int) -> list[Any]: ...
    def report(self, events: list[Event]) -> None: ...


@dataclass
class LoopStats:
    iterations: int = 0
    forwards: int = 0
    last_progress: float = field(default_factory=time.monotonic)  # watchdog only, never decisions


class RankLoop(Protocol):
    """What a rank's process, its stats push and its watchdog use of its loop: a `SlotLoop`, or
    an elastic node's loop, which holds one and replaces it at a flip (elastic_node/loop.py)."""

    @property
    def stats(self) -> LoopStats: ...
    @property
    def sched(self) -> Scheduler: ...
    @property
    def rank(self) -> int: ...
    @property
    def front(self) -> FrontIO | None: ...
    @property
    def spans(self) -> RankSpans: ...
    def iteration(self, t: int) -> None: ...
    def queue_sizes(self) -> dict[str, int]: ...
    def drain_samples(self) -> dict[str, list[float]]: ...
    def stats_extension(self) -> StatsExtension | None: ...
    def describe(self) -> str: ...
    def close(self) -> None: ...
