"""Moving a running process's threads to other cores: the router onto its fronts' cores
(router/cpu_affinity.py), an elastic rank onto its new role's cores (elastic_node/loop.py).
A thread started later inherits its creator's cores, so only the threads alive now are moved."""

from __future__ import annotations

import os
from collections.abc import Iterable


def _threads() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def bind_all_threads(cores: Iterable[int]) -> None:
    """Every thread of this process on `cores`."""
    cores = set(cores)
    for tid in _threads():
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, ValueError):  # the thread ended meanwhile
            continue


def move_threads(old: Iterable[int], new: Iterable[int]) -> int:
    """The threads of this process that run on `old` cores only, onto `new` (a thread bound
    elsewhere, e.g. a helper on an I/O core, stays); returns how many moved."""
    old, new = set(old), set(new)
    moved = 0
    for tid in _threads():
        try:
            if os.sched_getaffinity(tid) <= old:
                os.sched_setaffinity(tid, new)
                moved += 1
        except (ProcessLookupError, ValueError):
            continue
    return moved
