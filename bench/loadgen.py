"""Shared pieces of bench_pp.py and bench_pd.py: prompts, nodes as processes, a streaming load
generator, a queue sampler. Nodes are started with tests/cluster.py `start`
(own process group, always stopped)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cluster import free_port, start  # noqa: E402,F401


def make_prompts(n: int, seed: int, lo: int = 100, hi: int = 250) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def loadavg() -> str:
    a = os.getloadavg()
    return f"{a[0]:.2f}/{a[1]:.2f}/{a[2]:.2f}"


@dataclass
class ReqResult:
    ttft: float = float("nan")
    e2e: float = float("nan")
    times: list[float] = field(
        default_factory=list
    )  # arrival time of each token (relative to send)
    n_tokens: int = 0
    error: str | None = None

    @property
    def itl(self) -> float:
        return (
            (self.times[-1] - self.times[0]) / (self.n_tokens - 1)
            if self.n_tokens > 1
            else float("nan")
        )


async def stream_generate(
    c: httpx.AsyncClient, url: str, body: dict, t0: float, res: ReqResult
) -> None:
    """POST {url}/generate with stream=True; records the arrival of every token
    (SSE `data:` lines)."""
    async with c.stream("POST", f"{url}/generate", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if "error" in d:
                res.error = str(d["error"])[:200]
            toks = d.get("token_ids") or []
            if toks:
                now = time.perf_counter() - t0
                res.times.extend([now] * len(toks))
                res.n_tokens += len(toks)
    if res.times:
        res.ttft = res.times[0]
    res.e2e = time.perf_counter() - t0


@dataclass
class LevelResult:
    concurrency: int
    results: list[ReqResult]
    wall: float
    queues: dict[str, dict[str, float]] = field(
        default_factory=dict
    )  # node -> queue -> mean occupancy
    queue_times: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def ok(self) -> list[ReqResult]:
        return [r for r in self.results if r.error is None and r.n_tokens > 0]

    @property
    def errors(self) -> int:
        return len(self.results) - len(self.ok)

    @property
    def out_tokens(self) -> int:
        return sum(r.n_tokens for r in self.ok)

    def stat(self, name: str, q: float | None = None) -> float:
        v = sorted(getattr(r, name) for r in self.ok)
        if not v:
            return float("nan")
        if q is None:
            return statistics.fmean(v)
        return v[min(len(v) - 1, int(q * len(v)))]


async def run_level(
    prompts: list[list[int]], max_new: int, concurrency: int, send
) -> tuple[list[ReqResult], float]:
    """Runs every prompt with at most `concurrency` in flight;
    `send(client, ids, t0, res)` does one request."""
    sem = asyncio.Semaphore(concurrency)
    results = [ReqResult() for _ in prompts]

    async def one(i: int, c: httpx.AsyncClient):
        async with sem:
            t0 = time.perf_counter()
            try:
                await send(c, prompts[i], t0, results[i])
            except Exception as e:  # a failed request is counted, never hidden
                results[i].error = f"{type(e).__name__}: {e}"[:200]

    limits = httpx.Limits(
        max_connections=2 * concurrency + 8, max_keepalive_connections=2 * concurrency + 8
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as c:
        t = time.perf_counter()
        await asyncio.gather(*(one(i, c) for i in range(len(prompts))))
        wall = time.perf_counter() - t
    return results, wall


class QueueSampler:
    """Samples GET /server_info of each node every `period` s; mean occupancy of each queue at PP0.

    The ranks push their stats to the front every 0.5 s,
    so consecutive samples may repeat a value."""

    def __init__(self, nodes: dict[str, str], period: float = 0.1):
        self.nodes, self.period = nodes, period
        self.samples: dict[str, list[dict]] = {n: [] for n in nodes}
        self._task = None
        self._stop = asyncio.Event()

    async def _run(self):
        async with httpx.AsyncClient(timeout=5) as c:
            while not self._stop.is_set():
                for name, url in self.nodes.items():
                    try:
                        info = (await c.get(f"{url}/server_info")).json()
                        r0 = (info.get("ranks") or [None])[0]
                        if r0:
                            self.samples[name].append(r0)
                    except (httpx.HTTPError, ValueError):
                        pass
                try:
                    await asyncio.wait_for(self._stop.wait(), self.period)
                except TimeoutError:
                    pass

    def start(self):
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        await self._task
        out = {}
        for name, ss in self.samples.items():
            keys = [
                k
                for k in ("bootstrap", "prealloc", "transfer", "waiting", "running", "inflight")
                if ss and k in ss[0]
            ]
            out[name] = {k: statistics.fmean(s.get(k, 0) for s in ss) for k in keys}
            out[name]["_n"] = len(ss)
        return out


_QT = re.compile(r"^pdserve_queue_time_seconds_(sum|count)\{([^}]*)\}\s+([0-9.eE+-]+)")


def queue_time_counters(url: str) -> dict[str, list[float]]:
    """queue -> [sum, count] of pdserve_queue_time_seconds if the node exports it
    (empty otherwise)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _QT.match(line)
        if m:
            q = re.search(r'queue="([^"]+)"', m.group(2))
            if q:
                out.setdefault(q.group(1), [0.0, 0.0])[0 if m.group(1) == "sum" else 1] += float(
                    m.group(3)
                )
    return out


def queue_time_delta(before: dict, after: dict) -> dict[str, float]:
    out = {}
    for q, (s, n) in after.items():
        s0, n0 = before.get(q, [0.0, 0.0])
        if n - n0 > 0:
            out[q] = (s - s0) / (n - n0)
    return out


def fmt(x: float, scale: float = 1.0, nd: int = 0) -> str:
    return "n/a" if x != x else f"{x * scale:.{nd}f}"


@dataclass
class PDPair:
    purl: str
    pproc: object  # the prefill node's Popen
    durl: str
    bport: int  # the prefill node's bootstrap port


def start_pd_pair(st, logdir: Path, tag: str = "", decode_flags: tuple[str, ...] = ()) -> PDPair:
    """A prefill and a decode node (PP 1 each) on one core each (`--cpus 0`, `--cpus 1`, as
    `pdserve up` plans PP 1 + PP 1 on two cores), entered on the ExitStack `st`, both healthy."""
    from cluster import wait_healthy

    pport, bport, dport = free_port(), free_port(), free_port()
    plog, dlog = logdir / f"prefill{tag}.log", logdir / f"decode{tag}.log"
    prefill = ["prefill", "--port", str(pport), "--bootstrap-port", str(bport), "--cpus", "0"]
    purl, pproc = st.enter_context(start(prefill, pport, plog, wait=False))
    decode = ["decode", "--port", str(dport), "--cpus", "1", *decode_flags]
    durl, dproc = st.enter_context(start(decode, dport, dlog, wait=False))
    wait_healthy(purl, pproc, 400, plog)
    wait_healthy(durl, dproc, 400, dlog)
    return PDPair(purl, pproc, durl, bport)
