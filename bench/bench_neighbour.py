"""The busy-neighbour cliff: one 64-token request's latency on a colocated node, alone and next to a
process that keeps one core busy, for the default core plan and for two bound threads.

Unbound or bound, two OpenMP threads wait at every parallel region's barrier for the slower one; a
busy process on one of their cores makes that thread the slow one (measured before the core plan:
2.4 s -> 14.5 s). The default plan gives a node's one rank one core and keeps the other for I/O, so
a neighbour on the I/O core costs nothing and one on the compute core costs its share.

  .venv/bin/python bench/bench_neighbour.py [--model M] [--repeats 3]
      [--output bench/results/neighbour.md]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pdserve.infra.procs import free_port  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and the sea. " * 4


def start_node(model: str | None, threads: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--pp",
        "1",
        "--port",
        str(port),
        "--no-prefix-cache",
        *threads,
        *(["--model", model] if model else []),
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"node exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise TimeoutError("node not healthy after 300 s")


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def one_request(url: str) -> float:
    t = time.perf_counter()
    r = httpx.post(
        f"{url}/generate",
        json={
            "text": PROMPT,
            "sampling_params": {"max_tokens": 64, "temperature": 0, "ignore_eos": True},
        },
        timeout=300,
    )
    r.raise_for_status()
    return time.perf_counter() - t


def busy(core: int) -> subprocess.Popen:
    return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])


def measure(url: str, repeats: int, neighbour_core: int | None) -> float:
    nb = busy(neighbour_core) if neighbour_core is not None else None
    try:
        time.sleep(0.5)
        one_request(url)  # warm-up under the same conditions
        return statistics.median(one_request(url) for _ in range(repeats))
    finally:
        if nb is not None:
            nb.kill()
            nb.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs at least 2 cores")
    rows = []
    for name, flags in (
        ("default plan (1 compute core + 1 I/O core)", []),
        ("--threads 2 (both cores compute)", ["--threads", "2"]),
    ):
        proc, url = start_node(a.model, flags, Path(f"/tmp/bench_neighbour_{len(rows)}.log"))
        try:
            alone = measure(url, a.repeats, None)
            on0 = measure(url, a.repeats, 0)
            on1 = measure(url, a.repeats, 1)
        finally:
            stop(proc)
        rows.append((name, alone, on0, on1))
        print(
            f"{name}: alone {alone:.2f} s, busy core 0 {on0:.2f} s ({on0 / alone:.1f}x), "
            f"busy core 1 {on1:.2f} s ({on1 / alone:.1f}x)",
            flush=True,
        )
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    lines = [
        "| node | alone (s) | busy process on core 0 | busy process on core 1 |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {n} | {a_:.2f} | {b:.2f} ({b / a_:.1f}x) | {c:.2f} ({c / a_:.1f}x) |"
        for n, a_, b, c in rows
    ]
    text = (
        "\n".join(lines)
        + f"\n\nOne 64-token greedy request, median of {a.repeats}; load average after: "
        f"{' '.join(load)}.\n"
    )
    print(text)
    if a.output:
        Path(a.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
