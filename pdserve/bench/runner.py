"""One load against a server: a fixed number of requests in flight,
or a seeded Poisson arrival rate.

Warm-up requests run first (same load shape, records kept apart and left out of the stats). The
measured phase ends when `num_requests` were sent and answered, or when `duration` seconds passed
(requests already in flight then still finish), or when `stop` is set (Ctrl-C): in-flight requests
are cancelled and recorded as `cancelled`, and what finished is still reported.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from pdserve.bench.client import RequestRecord, Target, send
from pdserve.bench.workload import BenchRequest


@dataclass(frozen=True)
class Load:
    concurrency: int | None = None  # closed loop: this many requests always in flight
    request_rate: float | None = None  # open loop: Poisson arrivals, requests/s
    max_concurrency: int | None = None  # open loop: a cap on requests in flight

    def __post_init__(self):
        assert (self.concurrency is None) != (self.request_rate is None), (
            "one of concurrency, request_rate"
        )

    def label(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        cap = f" (max {self.max_concurrency} in flight)" if self.max_concurrency else ""
        return f"rate {self.request_rate:g}/s{cap}"

    def as_dict(self) -> dict:
        return {
            k: v
            for k, v in (
                ("concurrency", self.concurrency),
                ("request_rate", self.request_rate),
                ("max_concurrency", self.max_concurrency),
            )
            if v is not None
        }


@dataclass
class LoadResult:
    load: Load
    records: list[RequestRecord]
    warmup: list[RequestRecord]
    duration_s: float
    t0: float  # perf_counter at the start of the measured phase
    t0_unix: float  # the same moment on the wall clock, to line records up with other tools
    interrupted: bool = False


class Progress:
    """A tqdm bar on stderr when tqdm is installed, else one plain line at most every 2 s."""

    def __init__(self, label: str, total: int | None, enabled: bool):
        self.enabled, self.label, self.total, self.n = enabled, label, total, 0
        self.bar, self.last = None, 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=True)
            except ImportError:
                pass

    def update(self) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.enabled and (time.monotonic() - self.last > 2 or self.n == self.total):
            self.last = time.monotonic()
            of = f"/{self.total}" if self.total else ""
            print(f"[bench] {self.label}: {self.n}{of} requests done", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class _Phase:
    """The requests of one phase: hands out the next request until a bound is hit."""

    requests: list[BenchRequest]
    limit: int | None
    deadline: float | None
    stop: asyncio.Event
    warmup: bool = False
    records: list[RequestRecord] = field(default_factory=list)

    def take(self) -> RequestRecord | None:
        i = len(self.records)
        if (
            self.stop.is_set()
            or (self.limit is not None and i >= self.limit)
            or (self.deadline is not None and time.perf_counter() >= self.deadline)
        ):
            return None
        req = self.requests[i % len(self.requests)]
        rec = RequestRecord(req, warmup=self.warmup)
        self.records.append(rec)
        return rec


async def _send(
    client: httpx.AsyncClient, target: Target, rec: RequestRecord, progress: Progress
) -> None:
    await send(
        client, target, rec, client.timeout.read
    )  # the client's read timeout is --request-timeout
    progress.update()


async def _closed_loop(client, target, phase: _Phase, concurrency: int, progress: Progress) -> None:
    async def worker():
        while (rec := phase.take()) is not None:
            await _send(client, target, rec, progress)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _open_loop(
    client,
    target,
    phase: _Phase,
    rate: float,
    cap: int | None,
    rng: random.Random,
    progress: Progress,
) -> None:
    gate = asyncio.Semaphore(cap) if cap else None
    tasks: set[asyncio.Task] = set()

    async def one(rec: RequestRecord):
        if gate is None:
            return await _send(client, target, rec, progress)
        async with gate:
            await _send(client, target, rec, progress)

    next_at = time.perf_counter()
    try:
        while True:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = phase.take()
            if rec is None:
                break
            task = asyncio.create_task(one(rec))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += rng.expovariate(rate)
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        pending = list(tasks)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


async def _run_phase(
    client,
    target,
    load: Load,
    phase: _Phase,
    rng: random.Random,
    progress: Progress,
    warmup_concurrency: int | None = None,
) -> bool:
    """Runs one phase; returns True when `stop` cut it short."""
    if warmup_concurrency is not None:
        work = _closed_loop(client, target, phase, warmup_concurrency, progress)
    elif load.concurrency is not None:
        work = _closed_loop(client, target, phase, load.concurrency, progress)
    else:
        work = _open_loop(
            client, target, phase, load.request_rate, load.max_concurrency, rng, progress
        )
    main = asyncio.ensure_future(work)
    stopper = asyncio.ensure_future(phase.stop.wait())
    await asyncio.wait({main, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    interrupted = not main.done()
    if interrupted:
        main.cancel()
    await asyncio.gather(main, return_exceptions=True)
    for rec in phase.records:
        if rec.end is None and rec.error is None:
            rec.error = "cancelled"
    return interrupted


async def run_load(
    target: Target,
    load: Load,
    requests: list[BenchRequest],
    warmup: list[BenchRequest],
    *,
    num_requests: int | None,
    duration: float | None,
    arrival_seed: str,
    stop: asyncio.Event,
    request_timeout: float,
    progress: bool,
) -> LoadResult:
    in_flight = load.concurrency or load.max_concurrency
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    timeout = httpx.Timeout(request_timeout, connect=min(10.0, request_timeout))
    rng = random.Random(arrival_seed)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        warm = _Phase(warmup, len(warmup), None, stop, warmup=True)
        if warmup:
            bar = Progress(f"warm-up, {load.label()}", len(warmup), progress)
            burst = load.concurrency or load.max_concurrency or len(warmup)
            stopped = await _run_phase(
                client, target, load, warm, rng, bar, warmup_concurrency=burst
            )
            bar.close()
            if stopped:
                return LoadResult(
                    load, [], warm.records, 0.0, time.perf_counter(), time.time(), interrupted=True
                )
        t0, t0_unix = time.perf_counter(), time.time()
        phase = _Phase(requests, num_requests, None if duration is None else t0 + duration, stop)
        bar = Progress(load.label(), num_requests, progress)
        interrupted = await _run_phase(client, target, load, phase, rng, bar)
        bar.close()
    ends = [r.end for r in phase.records if r.end is not None]
    elapsed = (max(ends) if ends else time.perf_counter()) - t0
    return LoadResult(load, phase.records, warm.records, elapsed, t0, t0_unix, interrupted)
