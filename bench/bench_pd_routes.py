"""Issue #18's workloads on a real PD pair (SmolLM2-135M-Instruct, the model's own dtype; prefill
node PP 1 + decode node PP 1, each with its router in front; `pdserve router` processes):

  multi-turn   32 conversations of 3 turns with a shared system prompt, 8 at a time: KV bytes
               received by the decode node, TTFT p50/p99 and output tok/s, for
               (a) decode prefix cache off, every request disaggregated,
               (b) decode prefix cache on, every request disaggregated (partial transfers),
               (c) decode prefix cache on, conditional disaggregation (the router's defaults).
  short        64 prompts of 6-20 words, 8 at a time: always disaggregated vs conditional.
  dead prefill 8 clients in a closed loop for `--dead-s` seconds through the conditional router;
               the prefill node is SIGKILLed halfway: answers per second before and after, errors.

Two clusters are started (decode prefix cache off, then on); the routers of one cluster share its
nodes and run one after another. Every request is sent with temperature 0.

  .venv/bin/python bench/bench_pd_routes.py [--dead-s 30]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import platform
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import loadgen  # noqa: E402

SYSTEM = (
    "You are the support assistant of a company that runs large language model inference "
    "clusters. Answer in two or three sentences, plainly, and say when you are not sure. "
    "The clusters split prompt processing and token generation across separate machines, "
    "and move the attention cache between them over the network."
)
TOPICS = ["pages", "queues", "timeouts", "routing", "caching", "restarts", "metrics", "tracing"]
ALWAYS = [
    "--disagg-min-prompt-tokens",
    "0",
    "--disagg-decode-prefix-fraction",
    "2",
    "--disagg-local-prefill-cost",
    "0",
]
WORDS = [
    "the",
    "a",
    "cache",
    "page",
    "queue",
    "token",
    "prefill",
    "decode",
    "rank",
    "router",
    "slot",
    "layer",
]


class Cluster:
    def __init__(self, logdir: Path, decode_cache: bool, st: contextlib.ExitStack):
        self.logdir, self.st = logdir, st
        tag = "-cache" if decode_cache else "-nocache"
        flags = () if decode_cache else ("--no-prefix-cache",)
        pair = loadgen.start_pd_pair(st, logdir, tag, flags)
        self.purl, self.pproc, self.durl, self.bport = pair.purl, pair.pproc, pair.durl, pair.bport

    @contextlib.contextmanager
    def router(self, flags: list[str], name: str):
        port = loadgen.free_port()
        cmd = ["router", "--port", str(port), "--prefill", self.purl, str(self.bport)]
        cmd += ["--decode", self.durl, "--health-interval", "1", *flags]
        with loadgen.start(cmd, port, self.logdir / f"router-{name}.log", timeout=60) as (url, _):
            deadline = time.monotonic() + 60  # both nodes registered and healthy
            while httpx.get(f"{url}/health", timeout=5).json()["workers"]["prefill"][
                "eligible"
            ] < 1 and (time.monotonic() < deadline):
                time.sleep(0.3)
            yield url


def received_bytes(durl: str) -> float:
    text = httpx.get(f"{durl}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve_kv_transfer_bytes_total{")
    )


def decisions(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_router_route_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            if float(value):
                out[labels.split('reason="')[1].split('"')[0]] = float(value)
    return out


@functools.cache
def model_id(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


async def chat(c, url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int]:
    """Streams one chat completion; returns (TTFT s, text, completion tokens)."""
    body = {
        "model": model_id(url),
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0, ttft, text, n = time.perf_counter(), float("nan"), [], 0
    async with c.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = httpx.Response(200, content=line[6:]).json()
            if d.get("usage"):
                n = d["usage"]["completion_tokens"]
            for ch in d.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content")
                if piece:
                    if ttft != ttft:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return ttft, "".join(text), n


async def multi_turn(url: str, conversations: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    ttfts: dict[int, list[float]] = {0: [], 1: [], 2: []}
    tokens = 0

    async def one(i: int, c):
        nonlocal tokens
        msgs = [{"role": "system", "content": SYSTEM}]
        async with sem:
            for turn in range(3):
                topic = TOPICS[(i + turn) % 8]
                q = f"Conversation {i}, question {turn + 1}: tell me about {topic}."
                msgs.append({"role": "user", "content": q})
                ttft, text, n = await chat(c, url, [*msgs], 32)
                ttfts[turn].append(ttft)
                tokens += n
                msgs.append({"role": "assistant", "content": text})

    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as c:
        await asyncio.gather(*(one(i, c) for i in range(conversations)))
    return {"ttfts": ttfts, "tokens": tokens, "wall": time.perf_counter() - t}


async def short_prompts(url: str, n: int, concurrency: int) -> dict:
    rng, sem, ttfts, tokens = random.Random(5), asyncio.Semaphore(concurrency), [], 0
    qs = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 20))) for _ in range(n)]

    async def one(q, c):
        nonlocal tokens
        async with sem:
            ttft, _, k = await chat(c, url, [{"role": "user", "content": q}], 32)
            ttfts.append(ttft)
            tokens += k

    t = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as c:
        await asyncio.gather(*(one(q, c) for q in qs))
    return {"ttfts": ttfts, "tokens": tokens, "wall": time.perf_counter() - t}


async def dead_prefill(url: str, pproc, seconds: float, clients: int) -> dict:
    done: list[tuple[float, bool]] = []  # (finish time, ok)
    t0, rng = time.perf_counter(), random.Random(9)
    kill_at = t0 + seconds / 2

    async def client(c):
        while time.perf_counter() - t0 < seconds:
            q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 60)))
            try:
                await chat(c, url, [{"role": "user", "content": q}], 16)
                done.append((time.perf_counter(), True))
            except Exception:  # counted: an error is a result here
                done.append((time.perf_counter(), False))

    async def killer():
        await asyncio.sleep(max(0.0, kill_at - time.perf_counter()))
        os.killpg(pproc.pid, signal.SIGKILL)

    async with httpx.AsyncClient(timeout=300) as c:
        await asyncio.gather(killer(), *(client(c) for _ in range(clients)))
    half = seconds / 2
    before = [ok for t, ok in done if t < kill_at]
    after = [ok for t, ok in done if t >= kill_at]
    return {
        "before_rps": sum(before) / half,
        "after_rps": sum(after) / max(1e-9, time.perf_counter() - kill_at),
        "errors": sum(not ok for _, ok in done),
        "answers": sum(ok for _, ok in done),
    }


def pct(v: list[float], q: float) -> float:
    v = sorted(x for x in v if x == x)
    return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--short", type=int, default=64)
    ap.add_argument("--dead-s", type=float, default=30.0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/pd_routes.md"))
    args = ap.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="bench_routes_"))
    load0, t_all = loadgen.loadavg(), time.perf_counter()
    mt, sp = {}, {}
    with contextlib.ExitStack() as st:
        cl = Cluster(logdir, decode_cache=False, st=st)
        with cl.router(ALWAYS, "nocache") as url:
            b0 = received_bytes(cl.durl)
            mt["(a) no decode cache, always PD"] = asyncio.run(
                multi_turn(url, args.conversations, 8)
            )
            mt["(a) no decode cache, always PD"]["bytes"] = received_bytes(cl.durl) - b0
            mt["(a) no decode cache, always PD"]["routes"] = decisions(url)
    with contextlib.ExitStack() as st:
        cl = Cluster(logdir, decode_cache=True, st=st)
        for name, flags, key in (
            ("always", ALWAYS, "(b) decode cache, always PD"),
            ("cond", [], "(c) decode cache, conditional"),
        ):
            with cl.router(flags, name) as url:
                b0 = received_bytes(cl.durl)
                mt[key] = asyncio.run(multi_turn(url, args.conversations, 8))
                mt[key]["bytes"] = received_bytes(cl.durl) - b0
                mt[key]["routes"] = decisions(url)
                before = decisions(url)
                sp[name] = asyncio.run(short_prompts(url, args.short, 8))
                after = decisions(url)
                sp[name]["routes"] = {k: v - before.get(k, 0) for k, v in after.items()}
        with cl.router([], "dead") as url:
            dead = asyncio.run(dead_prefill(url, cl.pproc, args.dead_s, 8))
            dead["routes"] = decisions(url)
    rows = [
        "| configuration | KV bytes received | TTFT p50 ms turn 1 / 2 / 3 | TTFT p99 ms (all) "
        "| output tok/s | routes |",
        "|---|---:|---|---:|---:|---|",
    ]
    for name, m in mt.items():
        t = m["ttfts"]
        p50 = " / ".join(f"{pct(t[k], 0.5) * 1e3:.0f}" for k in range(3))
        p99 = pct(t[0] + t[1] + t[2], 0.99) * 1e3
        rows.append(
            f"| {name} | {m['bytes'] / 1e6:.1f} MB | {p50} | {p99:.0f} | "
            f"{m['tokens'] / m['wall']:.1f} | {m['routes']} |"
        )
    srows = [
        "| router | TTFT p50 ms | TTFT p99 ms | output tok/s | routes |",
        "|---|---:|---:|---:|---|",
    ]
    for name, m in sp.items():
        srows.append(
            f"| {'always disaggregated' if name == 'always' else 'conditional (defaults)'} | "
            f"{pct(m['ttfts'], 0.5) * 1e3:.0f} | {pct(m['ttfts'], 0.99) * 1e3:.0f} | "
            f"{m['tokens'] / m['wall']:.1f} | {m['routes']} |"
        )
    text = "\n".join(
        [
            "# PD routes: decode prefix cache, conditional disaggregation, a dead prefill node",
            "",
            f"Machine: {os.cpu_count()} CPUs ({platform.machine()}); load average at start "
            f"{load0}, "
            f"at the end {loadgen.loadavg()}; whole script {time.perf_counter() - t_all:.0f} s. "
            "SmolLM2-135M-Instruct in its own dtype, `pdserve prefill` + `pdserve decode` (PP 1 "
            "each, one core each) behind `pdserve router`; chat completions streamed, "
            "temperature 0. Logs: " + str(logdir) + ".",
            "",
            f"## Multi-turn chat ({args.conversations} conversations x 3 turns, 8 at a time, "
            "32 output tokens)",
            "",
            *rows,
            "",
            f"## Short prompts ({args.short} prompts of 6-20 words, 8 at a time, 32 output tokens)",
            "",
            *srows,
            "",
            f"## Dead prefill node (8 clients, {args.dead_s:g} s, SIGKILL at half time)",
            "",
            "| answers/s before | answers/s after | answers | errors | routes |",
            "|---:|---:|---:|---:|---|",
            f"| {dead['before_rps']:.2f} | {dead['after_rps']:.2f} | {dead['answers']} | "
            f"{dead['errors']} | {dead['routes']} |",
            "",
            "Command: `.venv/bin/python bench/bench_pd_routes.py`",
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
