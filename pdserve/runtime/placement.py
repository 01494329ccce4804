"""Which cores each rank's compute threads own, and which core the I/O processes use.

Unbound OpenMP threads fall off a cliff under load: a rank with two threads on a 2-core host, next
to one busy process, took several times as long per request, because every parallel region waits
at a barrier for a thread that is descheduled (measured: bench/results/HISTORY.md). So every rank
binds its threads to cores no other rank's compute thread uses, and when cores are left over one
of them is kept for the I/O processes (fronts, router, transfer threads float there), as vLLM keeps
one for its API server. Only when there are more ranks than cores do ranks share a core, one
thread each, and the plan says so.

The plan is plain data, computed by whoever starts the ranks of a host (`pdserve up` for all the
nodes it starts, else each node for its own ranks) and logged.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    rank_cores: tuple[
        tuple[int, ...], ...
    ]  # per rank, in start order: the cores its threads run on
    io_cores: tuple[int, ...]  # fronts and router; () = no core left, they float

    @property
    def shared(self) -> bool:
        """True when some core runs the compute threads of more than one rank."""
        flat = [c for cores in self.rank_cores for c in cores]
        return len(flat) != len(set(flat))

    def front_cores(self, last_rank_shares: bool) -> tuple[int, ...]:
        """Where the fronts and the router run: the I/O cores; with none left over, the last
        rank's cores when `last_rank_shares` (a rank that loses only throughput to them), else
        () (they float)."""
        if self.io_cores or not last_rank_shares:
            return self.io_cores
        return self.rank_cores[-1]

    def describe(self, names: Sequence[str], front_cores: Sequence[int] = ()) -> str:
        ranks = ", ".join(
            f"{n} -> {_cores(c)}" for n, c in zip(names, self.rank_cores, strict=True)
        )
        io = _cores(self.io_cores) if self.io_cores else "any core (none left over)"
        if front_cores and not self.io_cores:
            io = f"{_cores(front_cores)} (none left over: shared with {names[-1]})"
        note = "; cores shared by ranks (more ranks than cores)" if self.shared else ""
        return f"{ranks}; fronts/router -> {io}{note}"

    def flag(self, start: int, count: int) -> str:
        """`--cpus` for `count` ranks from rank `start` on: cores by comma, ranks by ';'."""
        return ";".join(",".join(map(str, c)) for c in self.rank_cores[start : start + count])


def _cores(cores: Sequence[int]) -> str:
    return ("core " if len(cores) == 1 else "cores ") + ",".join(map(str, cores))


def plan_placement(n_ranks: int, cores: Sequence[int], threads: int = 0) -> Placement:
    """Cores for `n_ranks` ranks on a host whose usable cores are `cores`.

    `threads` 0 (auto): one core is kept for I/O when there are more cores than ranks, and the rest
    are split into contiguous blocks, one per rank (earlier ranks get the extra core of an uneven
    split). `threads` N: each rank gets N cores where the host has them, the rest go to I/O.
    With fewer cores than ranks, ranks take one core each, round-robin.
    """
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    cores = sorted(set(cores))
    if not cores:
        raise ValueError("no cores to place ranks on")
    if threads:
        want = n_ranks * threads
        if want <= len(cores):
            compute, io = cores[:want], cores[want:]
            return Placement(
                tuple(tuple(compute[i * threads : (i + 1) * threads]) for i in range(n_ranks)),
                tuple(io),
            )
        return _round_robin(n_ranks, cores)
    if n_ranks >= len(cores):
        return _round_robin(n_ranks, cores)
    compute, io = cores[:-1], cores[-1:]
    base, extra = divmod(len(compute), n_ranks)
    blocks, at = [], 0
    for i in range(n_ranks):
        n = base + (1 if i < extra else 0)
        blocks.append(tuple(compute[at : at + n]))
        at += n
    return Placement(tuple(blocks), tuple(io))


def _round_robin(n_ranks: int, cores: list[int]) -> Placement:
    return Placement(tuple((cores[i % len(cores)],) for i in range(n_ranks)), ())


def parse_cpus(text: str, n_ranks: int) -> tuple[tuple[int, ...], ...]:
    """`--cpus "0,1;2"`: the cores of each local rank, ranks separated by ';'."""
    try:
        groups = tuple(tuple(int(c) for c in g.split(",") if c.strip()) for g in text.split(";"))
    except ValueError:
        raise ValueError(
            f"--cpus {text!r}: expected core numbers, e.g. '0,1;2' (ranks by ';')"
        ) from None
    if len(groups) != n_ranks or any(not g for g in groups):
        raise ValueError(
            f"--cpus {text!r} names {len(groups)} core group(s) for {n_ranks} local rank(s)"
        )
    allowed = os.sched_getaffinity(0)
    bad = sorted({c for g in groups for c in g} - allowed)
    if bad:
        raise ValueError(
            f"--cpus {text!r}: core(s) {bad} are not available to this process ({sorted(allowed)})"
        )
    return groups


def parse_io_cpus(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise ValueError(f"--io-cpus {text!r}: expected core numbers, e.g. '3'") from None


def bind_cores(cores: Sequence[int]) -> None:
    """Binds this thread, and every thread it starts from now on (OpenMP's pool, the transfer
    threads), to `cores`. No-op for an empty list."""
    if cores:
        os.sched_setaffinity(0, set(cores))
