"""Router overhead benchmark: latency added by the router, and requests/s through it.

Starts a stub prefill node, a stub decode node (tests/stub_node.py, answering at once) and the
router, each as its own process on loopback. For each concurrency it runs the same load twice:
  direct: POST /generate straight to the decode stub (what a node alone costs);
  router: POST /v1/chat/completions through the router (OpenAI parsing, PD pair, prefill + decode
          calls, response building).
Added latency = router percentile - direct percentile. Non-streaming, 4 output tokens.

  .venv/bin/python bench/bench_router.py [--requests-scale 1.0] [--out bench/results/router.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
LEVELS = ((1, 300), (64, 2000), (256, 3000))  # (concurrency, requests)
MESSAGES = [{"role": "user", "content": "the quick brown fox jumps over the lazy dog"}]


def start(cmd: list[str]) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    line = proc.stdout.readline().strip()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"{cmd} did not start: {line!r}")
    return proc, int(line.split()[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


async def load(
    url: str, body: dict, concurrency: int, requests: int
) -> tuple[list[float], float, int]:
    limits = httpx.Limits(
        max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=4.0
    )  # below the servers' 5 s keep-alive
    latencies: list[float] = []
    errors: list[str] = []
    next_id = 0
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def worker():
            nonlocal next_id
            while next_id < requests:
                next_id += 1
                t0 = time.perf_counter()
                try:
                    r = await client.post(url, json=body)
                    if r.status_code != 200:
                        raise RuntimeError(f"{r.status_code} {r.text[:200]}")
                except (httpx.HTTPError, RuntimeError) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                latencies.append(time.perf_counter() - t0)

        for _ in range(min(50, requests)):  # warm-up, not measured
            await client.post(url, json=body)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    if errors:
        print(f"{url}: {len(errors)} errors, first: {errors[0]}", flush=True)
    return latencies, wall, len(errors)


def pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests-scale", type=float, default=1.0)
    parser.add_argument("--out", default=str(ROOT / "bench/results/router.md"))
    parser.add_argument("--router-log", default="/tmp/pdserve_bench_router.log")
    args = parser.parse_args()
    py = sys.executable
    procs = []
    with open(args.router_log, "w") as router_log:
        try:
            stub = [py, "tests/stub_node.py", "--port", "0", "--natural-tokens", "4"]
            prefill, p_port = start(stub + ["--role", "prefill", "--bootstrap-port", "8998"])
            procs.append(prefill)
            decode, d_port = start(stub + ["--role", "decode"])
            procs.append(decode)
            r_port = free_port()
            procs.append(
                subprocess.Popen(
                    [
                        py,
                        "-m",
                        "pdserve.router.cli",
                        "--prefill",
                        f"http://127.0.0.1:{p_port}",
                        "--decode",
                        f"http://127.0.0.1:{d_port}",
                        "--port",
                        str(r_port),
                        "--log-level",
                        "warning",
                        "--max-concurrent",
                        "1024",
                        "--max-queue",
                        "4096",
                        "--connect-timeout",
                        "30",
                    ],
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=router_log,
                )
            )
            router = f"http://127.0.0.1:{r_port}"
            wait_ready(router + "/health")
            rows = []
            for concurrency, n in LEVELS:
                n = max(concurrency, int(n * args.requests_scale))
                direct, d_wall, d_err = asyncio.run(
                    load(
                        f"http://127.0.0.1:{d_port}/generate",
                        {"messages": MESSAGES, "sampling_params": {"max_tokens": 4}},
                        concurrency,
                        n,
                    )
                )
                routed, r_wall, r_err = asyncio.run(
                    load(
                        router + "/v1/chat/completions",
                        {"model": "stub-model", "messages": MESSAGES, "max_tokens": 4},
                        concurrency,
                        n,
                    )
                )
                row = {
                    "c": concurrency,
                    "n": n,
                    "d50": pct(direct, 50),
                    "d99": pct(direct, 99),
                    "r50": pct(routed, 50),
                    "r99": pct(routed, 99),
                    "d_rps": len(direct) / d_wall,
                    "r_rps": len(routed) / r_wall,
                    "errors": d_err + r_err,
                }
                rows.append(row)
                print(row, flush=True)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    ms = lambda s: f"{s * 1000:.2f}"  # noqa: E731
    lines = [
        "# Router overhead (stub nodes that answer at once)",
        "",
        f"Machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
        f"Python {platform.python_version()}; load generator, router and both stubs share it "
        f"(load average at the end: {os.getloadavg()[0]:.1f}, other jobs included).",
        "Non-streaming chat, 4 output tokens. Direct = POST /generate to the decode stub; "
        "router = POST /v1/chat/completions through the router (prefill + decode calls). "
        "Router flags: --max-concurrent 1024 --max-queue 4096 --connect-timeout 30 (so CPU "
        "starvation on the shared machine shows as latency, not as connect errors).",
        "",
        "| concurrency | requests | direct p50 ms | direct p99 ms | router p50 ms | router p99 ms "
        "| added p50 ms | added p99 ms | direct req/s | router req/s | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['c']} | {r['n']} | {ms(r['d50'])} | {ms(r['d99'])} | {ms(r['r50'])} "
            f"| {ms(r['r99'])} | {ms(r['r50'] - r['d50'])} | {ms(r['r99'] - r['d99'])} "
            f"| {r['d_rps']:.0f} | {r['r_rps']:.0f} | {r['errors']} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
