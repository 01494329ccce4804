"""Soak: a whole `pdserve up` cluster under moderate streaming load for a long time;
does any process leak?

Starts `pdserve up` (default: the real default model; `--model` picks another, e.g. a tiny HF
folder), drives streaming chat requests at a fixed concurrency for `--duration` seconds, a fraction
of them cancelled by the client after a few tokens (a real socket close), and samples the resident
memory (VmRSS) and open file descriptors of every process of the cluster — found by walking /proc
from the launcher's pid — at start, every `--sample-every` seconds, and at two idle moments: the
baseline, after `--warmup` seconds of load (first connections, caches and allocator arenas are made
by then), and the end, after the rest of the load. Both idle samples follow `IDLE_S` without load,
so keep-alive sockets have closed and aborted rooms are released. Verdict per process:

  RSS    end <= baseline * (1 + rss_growth_pct / 100)
  fds    end <= baseline + fd_slack
  alive  the process exists from start to end

(the processes and their samples: bench/soak_procs.py; the verdict and the table: soak_report.py)

Writes a JSON report and a markdown table (`--out`, default bench/results/soak.{json,md}) and exits
1 if anything failed. Everything it started is stopped, also on Ctrl-C or SIGTERM.

  .venv/bin/python bench/soak.py [--duration 600] [--model PATH] [--concurrency 8]
  make soak SOAK_ARGS="--duration 180 --model /path/to/tiny"
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
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak_procs import Sampler, process_tree, read_proc  # noqa: E402
from soak_report import judge, markdown  # noqa: E402

IDLE_S = 10.0  # no load before the baseline and end samples (uvicorn's keep-alive is 5 s)
# fmt: off
WORDS = [
    "the", "cache", "page", "prefill", "decode", "rank", "router", "slot", "layer", "token",
    "pipeline", "transfer", "what", "is", "a", "good", "way", "to", "explain", "why", "memory",
    "grows", "when", "requests", "are", "cancelled", "early",
]
# fmt: on


# --- the load -------------------------------------------------------------------------------------


@dataclass
class LoadStats:
    sent: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: int = 0
    tokens: int = 0
    last_errors: list[str] = field(default_factory=list)


async def drive(
    url: str,
    model: str,
    seconds: float,
    concurrency: int,
    max_tokens: int,
    cancel_fraction: float,
    seed: int,
    stats: LoadStats,
) -> None:
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds

    async def one(client: httpx.AsyncClient) -> None:
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
        cancel_after = rng.randint(1, 4) if rng.random() < cancel_fraction else 0
        body = {
            "model": model,
            "messages": [{"role": "user", "content": q}],
            "stream": True,
            "max_tokens": rng.randint(max_tokens // 2, max_tokens),
            "temperature": 0,
        }
        stats.sent += 1
        pieces = 0
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        stats.completed += 1
                        return
                    if not line.startswith("data: "):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"stream error: {chunk['error'].get('message')}")
                    if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                        pieces += 1
                        stats.tokens += 1
                        if cancel_after and pieces >= cancel_after:
                            stats.cancelled += 1
                            return  # closes the socket mid-stream
                raise RuntimeError("the stream ended without [DONE]")
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            stats.errors += 1
            stats.last_errors = (stats.last_errors + [f"{type(e).__name__}: {e}"[:200]])[-10:]

    async def worker(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            await one(client)

    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30)) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


# --- the cluster ----------------------------------------------------------------------------------


def up_args(args) -> list[str]:
    """`pdserve up`'s args from this script's (and bench_abuse.py's) own."""
    out = ["--prefill-pp", str(args.prefill_pp), "--decode-pp", str(args.decode_pp)]
    out += [f"--node-args={args.node_args}"] if args.node_args else []
    out += [f"--router-args={args.router_args}"] if getattr(args, "router_args", "") else []
    return out + (["--model", args.model] if args.model else [])


def start_cluster(port: int, args: list[str], log_path: Path) -> subprocess.Popen:
    """`pdserve up --port PORT ARGS...`, its output into `log_path`, in a session of its own (so
    `stop_cluster` reaches every process it starts); Ctrl-C at its default in it."""
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port), *args]
    with open(log_path, "wb") as f:
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def wait_ready(proc: subprocess.Popen, log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while "[up] ready" not in log_path.read_text(errors="replace"):
        if proc.poll() is not None:
            raise RuntimeError(
                f"pdserve up exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"pdserve up not ready after {timeout:.0f} s:\n{log_path.read_text()[-3000:]}"
            )
        time.sleep(0.5)


def stop_cluster(proc: subprocess.Popen) -> list[int]:
    """Ctrl-C to `pdserve up` (its own orderly stop); returns the cluster's processes still alive
    60 s later or after `up` exited (orphans), then SIGKILLs whatever is left of the group."""
    pids = process_tree(proc.pid)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    time.sleep(1.0)
    left = [p for p in pids if read_proc(p) is not None]  # `up` itself too, if it did not exit
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    return left


# --- main -----------------------------------------------------------------------------------------


def interrupt(_signum, _frame) -> None:
    """Ctrl-C and SIGTERM end the soak; the `finally` stops the cluster."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model",
        default=os.environ.get("PDSERVE_MODEL"),
        help="GGUF file or HF folder (default: pdserve's default model, SmolLM2-135M-Instruct)",
    )
    ap.add_argument(
        "--duration", type=float, default=600.0, help="seconds of load, warm-up included"
    )
    ap.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds of load before the idle baseline (default: 20 %% of --duration)",
    )
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--cancel-fraction", type=float, default=0.2)
    ap.add_argument("--sample-every", type=float, default=10.0)
    ap.add_argument("--rss-growth-pct", type=float, default=10.0)
    ap.add_argument("--fd-slack", type=int, default=4)
    ap.add_argument("--prefill-pp", type=int, default=2)
    ap.add_argument("--decode-pp", type=int, default=2)
    ap.add_argument("--node-args", default="--threads 1")
    ap.add_argument("--port", type=int, default=0, help="router port (default: a free one)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        type=Path,
        default=ROOT / "bench" / "results" / "soak",
        help="writes OUT.json and OUT.md",
    )
    args = ap.parse_args(argv)
    if args.warmup is None:
        args.warmup = 0.2 * args.duration
    if not 0 < args.warmup < args.duration:
        ap.error("--warmup must be between 0 and --duration")
    if not args.port:
        sys.path.insert(0, str(ROOT))
        from pdserve.infra.procs import free_port

        args.port = free_port()

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(
        signal.SIGINT, interrupt
    )  # also when started with SIGINT ignored (a background job)
    log_path = Path(tempfile.mkdtemp(prefix="pdserve-soak-")) / "up.log"
    print(f"[soak] starting pdserve up (log {log_path})", flush=True)
    proc = start_cluster(args.port, up_args(args), log_path)
    report: dict = {}
    leftovers: list[int] = []
    try:
        wait_ready(proc, log_path, args.startup_timeout)
        url = f"http://127.0.0.1:{args.port}"
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        sampler = Sampler(proc.pid)
        sampler.sample()
        print(
            f"[soak] ready: {len(sampler.procs)} processes; {args.duration:.0f} s of load on "
            f"{model}",
            flush=True,
        )
        stats = LoadStats()

        async def phase(seconds: float, seed: int) -> float:
            """Load for `seconds` with periodic samples, then IDLE_S idle;
            returns the idle sample's time."""
            load = asyncio.create_task(
                drive(
                    url,
                    model,
                    seconds,
                    args.concurrency,
                    args.max_tokens,
                    args.cancel_fraction,
                    seed,
                    stats,
                )
            )
            while not load.done():
                await asyncio.wait({load}, timeout=args.sample_every)
                sampler.sample()
                rss = sum(s.rss_kib[-1] for s in sampler.procs.values() if s.gone_at is None) / 1024
                print(
                    f"[soak] t={time.monotonic() - sampler.t0:5.0f} s  sent {stats.sent}  done "
                    f"{stats.completed}  cancelled {stats.cancelled}  errors {stats.errors}  "
                    f"cluster RSS {rss:.0f} MiB  load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
            load.result()
            await asyncio.sleep(IDLE_S)
            sampler.sample()
            return sampler.procs[proc.pid].t[-1]

        async def run() -> tuple[float, float]:
            base = await phase(args.warmup, args.seed)
            print(f"[soak] idle baseline at t={base:.0f} s", flush=True)
            return base, await phase(args.duration - args.warmup, args.seed + 1)

        base_t, end_t = asyncio.run(run())
        rows = judge(sampler.procs, base_t, end_t, args.rss_growth_pct, args.fd_slack)
        problems = [f"{r['name']}: {p}" for r in rows for p in r["problems"]]
        if stats.errors:
            problems.append(f"{stats.errors} requests failed (last: {stats.last_errors[-1]})")
        if stats.completed == 0:
            problems.append("no request completed")
        report = {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "host": f"{platform.node()} ({os.cpu_count()} cores)",
            "model": model,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "load": asdict(stats),
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "processes": rows,
            "series": [asdict(s) for s in sampler.procs.values()],
            "problems": problems,
            "passed": not problems,
        }
    except KeyboardInterrupt:
        print("[soak] interrupted; stopping the cluster", flush=True)
        return 130
    except (RuntimeError, TimeoutError) as e:
        print(f"[soak] error: {e}", flush=True)
        return 1
    finally:
        leftovers = stop_cluster(proc)
        if leftovers:
            print(
                f"[soak] processes still alive after Ctrl-C to pdserve up: {leftovers}", flush=True
            )
    if leftovers:
        report["problems"].append(f"processes still alive after Ctrl-C to pdserve up: {leftovers}")
        report["passed"] = False
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    md = markdown(report)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    print(
        f"[soak] wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.md')}",
        flush=True,
    )
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
