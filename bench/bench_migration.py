"""The stall a client sees when its decode node dies mid-stream (router/routing/migration.py),
next to the inter-token latency of the same streams undisturbed.

A router, a prefill node and two decode nodes (SmolLM2-135M-Instruct, the model's own dtype unless
--dtype), real processes on loopback. `--streams` greedy streams (`POST /generate`, `ignore_eos`)
go at once:
  1. undisturbed, twice: the inter-token gaps (ITL) and each stream's tokens;
  2. `--rounds` times: once every stream has `--after` tokens, SIGKILL of the front of the decode
     node holding more of them (its ranks die with it); the streams it held move to the other
     decode node. Each round the killed node is started again before the next.
Reports the stall of each migrated stream (a client sees a migration as a new node-side `rid` in the
events: the stall is the gap from the last event of the old rid to the first of the new) as
p50/p99 against the undisturbed ITL p50/p99, and how many streams kept exactly the undisturbed
tokens.

  .venv/bin/python bench/bench_migration.py [--streams 16] [--rounds 3] [--dtype float32]
      [--batch-invariant]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One `pdserve` command in its own process group; stop() ends the group."""

    def __init__(self, args: list[str], log: Path):
        self.args, self.log = args, log
        with open(log, "ab") as f:
            self.p = subprocess.Popen(
                [PY, "-m", "pdserve.cli", *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                process_group=0,
            )  # fmt: skip

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.p.wait(timeout=10)
                return


def wait_ok(url: str, proc: Proc, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        if proc.p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args[0]} did not start: see {proc.log}")
        time.sleep(0.5)


class Stream:
    def __init__(self):
        self.tokens: list[int] = []
        self.times: list[float] = []  # arrival of each event with tokens
        self.error: str | None = None
        self.rids: list[str] = []  # the node-side rid of each event: a new one after a migration
        self.stalls: list[float] = []  # per migration: last event of one rid to the next's first

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


async def one(c: httpx.AsyncClient, url: str, ids: list[int], max_new: int, s: Stream) -> None:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_tokens": max_new, "ignore_eos": True}}  # fmt: skip
    async with c.stream("POST", url + "/generate", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("error"):
                s.error = ev["error"].get("message")
            if ev.get("token_ids"):
                now = time.perf_counter()
                if s.rids and ev.get("rid") != s.rids[-1]:
                    s.stalls.append(now - s.times[-1])
                s.tokens.extend(ev["token_ids"])
                s.times.append(now)
                s.rids.append(ev.get("rid"))


def run(url: str, prompts, max_new: int, fault=None) -> list[Stream]:
    async def main():
        streams = [Stream() for _ in prompts]
        async with httpx.AsyncClient(timeout=600) as c:
            tasks = [
                asyncio.create_task(one(c, url, p, max_new, s))
                for p, s in zip(prompts, streams, strict=True)
            ]
            hit = await asyncio.to_thread(fault, streams) if fault else None
            await asyncio.gather(*tasks)
        return streams, hit

    return asyncio.run(main())


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new", type=int, default=160)
    ap.add_argument("--after", type=int, default=24, help="tokens every stream has at the kill")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-invariant", action="store_true", help="the nodes' flag (bf16)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/migration.md"))
    args = ap.parse_args()
    logdir = Path(tempfile.mkdtemp(prefix="bench_migration_"))
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 20000) for _ in range(rng.randrange(40, 160))]
               for _ in range(args.streams)]  # fmt: skip
    node = ["--dtype", args.dtype, "--threads", "1"]
    node += ["--batch-invariant"] if args.batch_invariant else []
    ports = {n: free_port() for n in ("p", "b", "d1", "d2", "r")}
    url = {n: f"http://127.0.0.1:{ports[n]}" for n in ports}
    procs: dict[str, Proc] = {}

    def start_decode(name: str) -> None:
        procs[name] = Proc(["decode", "--port", str(ports[name]), *node], logdir / f"{name}.log")

    t_all = time.perf_counter()
    try:
        procs["p"] = Proc(["prefill", "--port", str(ports["p"]), "--bootstrap-port",
                           str(ports["b"]), *node], logdir / "p.log")  # fmt: skip
        for d in ("d1", "d2"):
            start_decode(d)
        for n in ("p", "d1", "d2"):
            wait_ok(url[n], procs[n])
        procs["r"] = Proc(["router", "--port", str(ports["r"]), "--prefill", url["p"],
                           str(ports["b"]), "--decode", url["d1"], "--decode", url["d2"],
                           "--health-interval", "0.5", "--health-failure-threshold", "2",
                           "--decode-policy", "round_robin", "--cb-failure-threshold", "100000"],
                          logdir / "router.log")  # fmt: skip
        wait_ok(url["r"], procs["r"])
        run(url["r"], prompts[:2], 8)  # warm-up
        base = [run(url["r"], prompts, args.max_new)[0] for _ in range(2)]
        want = [s.tokens for s in base[0]]
        itl = [g for streams in base for s in streams for g in s.gaps()]
        stable = sum(a.tokens == b.tokens for a, b in zip(*base, strict=True))
        stalls, exact, moved, errors = [], 0, 0, 0

        def kill(streams):
            while min(len(s.tokens) for s in streams) < args.after:
                time.sleep(0.005)
            load = httpx.get(url["r"] + "/workers", timeout=5).json()
            busy = {w["url"]: w["in_flight"] for w in load["workers"] if w["role"] == "decode"}
            name = max(("d1", "d2"), key=lambda d: busy.get(url[d], 0))
            pid = httpx.get(url[name] + "/server_info", timeout=5).json()["pid"]
            os.kill(pid, signal.SIGKILL)
            return name

        for _ in range(args.rounds):
            streams, name = run(url["r"], prompts, args.max_new, kill)
            for s, w in zip(streams, want, strict=True):
                errors += s.error is not None
                exact += s.tokens == w
                moved += bool(s.stalls)
                stalls += s.stalls
            procs[name].stop()
            start_decode(name)
            wait_ok(url[name], procs[name])
            time.sleep(2)  # the router's probes see it healthy
        metrics = httpx.get(url["r"] + "/metrics", timeout=5).text
    finally:
        for p in procs.values():
            p.stop()
    n_all = args.rounds * args.streams
    lines = [
        "# Mid-stream migration: the stall a client sees (bench/bench_migration.py)",
        "",
        f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), load average at the end "
        f"{os.getloadavg()[0]:.1f}; whole script {time.perf_counter() - t_all:.0f} s. Router, one "
        f"prefill node and two decode nodes (PP 1, dtype {args.dtype}"
        f"{', --batch-invariant' if args.batch_invariant else ''}, SmolLM2-135M-Instruct); "
        f"{args.streams} greedy streams of {args.max_new} tokens at once, prompts of 40 to 160 "
        f"tokens; {args.rounds} rounds, each a SIGKILL of the busier decode node's front once "
        f"every stream has {args.after} tokens. Logs: {logdir}.",
        "",
        "| | p50 ms | p99 ms | max ms | samples |",
        "|---|---:|---:|---:|---:|",
        f"| undisturbed ITL (2 runs) | {pct(itl, 0.5) * 1e3:.1f} | {pct(itl, 0.99) * 1e3:.1f} | "
        f"{max(itl) * 1e3:.1f} | {len(itl)} |",
        f"| stall of a migrated stream | {pct(stalls, 0.5) * 1e3:.1f} | "
        f"{pct(stalls, 0.99) * 1e3:.1f} | {max(stalls, default=float('nan')) * 1e3:.1f} | "
        f"{len(stalls)} |",
        "",
        f"Streams moved: {moved} of {n_all}; errors: {errors}; streams with exactly the "
        f"undisturbed tokens: {exact} of {n_all} (two undisturbed runs agreed on {stable} of "
        f"{args.streams}).",
        "",
        "Router counters at the end:",
        "",
        "```",
        *[ln for ln in metrics.splitlines() if ln.startswith("pdserve_router_migrat")],
        *[ln for ln in metrics.splitlines() if 'reason="migration"' in ln],
        "```",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
