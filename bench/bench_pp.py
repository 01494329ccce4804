"""Pipeline-parallel benchmarks.

(a) Control overhead of the slot loop: PP = 1, 2, 4 real rank processes (torch.distributed gloo on
    loopback) each run `SlotLoop.iteration` with no requests (the metronome: a meta message every
    iteration, no forward, no ring) on a PPComm, a real Scheduler and a dummy runner that is never
    called. After a warm-up, every rank times `--iters` iterations; reported: median and p99 µs per
    iteration, and wall / iterations, per rank (the max over ranks is the pipeline's rhythm).
(b) Throughput of PP = 2 (1 torch thread per rank) vs PP = 1 (2 threads) on SmolLM2-135M-Instruct
    with the same total threads: `pdserve serve --pp N --threads T` as a process, `--requests`
    requests (prompts of 100-250 seeded random token ids, 64 output tokens, ignore_eos) with
    `--concurrency` in flight through POST /generate (streaming); output tokens/s and TTFT.

  .venv/bin/python bench/bench_pp.py [--iters 2000] [--requests 32] [--concurrency 32]
      [--skip-a] [--skip-b]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen  # noqa: E402


# --- (a) the empty slot loop ----------------------------------------------------------------------
def _rank(rank: int, size: int, init: str, warmup: int, iters: int, q) -> None:
    import torch

    torch.set_num_threads(1)
    from pdserve.engine.kv_cache import PageAllocator
    from pdserve.engine.scheduler import Scheduler, SchedulerConfig
    from pdserve.runtime.rank.pp_comm import PPComm
    from pdserve.runtime.rank.slot_loop import LoopConfig, SlotLoop

    class NeverRunner:  # batches are empty: forward/sample are never called
        def forward(self, *a, **k):
            raise AssertionError("forward called on an empty batch")

        sample = forward

    comm = PPComm(rank, size, init_method=init, timeout_s=60) if size > 1 else None
    cfg = LoopConfig(pp_size=size)
    sched = Scheduler(SchedulerConfig(num_slots=cfg.num_slots), PageAllocator(1024), (2,))
    loop = SlotLoop(cfg, comm, NeverRunner(), sched, front=None)
    for t in range(warmup):
        loop.iteration(t)
    ts = []
    t_all = time.perf_counter()
    for t in range(warmup, warmup + iters):
        t1 = time.perf_counter()
        loop.iteration(t)
        ts.append(time.perf_counter() - t1)
    wall = time.perf_counter() - t_all
    if comm:
        comm.flush()
        comm.all_min_max([0])  # nobody leaves before everyone is done
    ts.sort()
    q.put(
        (
            rank,
            statistics.median(ts),
            ts[int(0.99 * len(ts))],
            wall / iters,
            loop.stats.forwards,
            comm.bytes_sent if comm else 0,
        )
    )
    if comm:
        comm.close()


def bench_loop(size: int, warmup: int, iters: int) -> list[tuple]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init = f"tcp://127.0.0.1:{loadgen.free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, size, init, warmup, iters, q)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        out = [q.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return sorted(out)


# --- (b) PP = 2 vs PP = 1 through a colocated node ------------------------------------------------
def bench_node(pp: int, threads: int, prompts, max_new: int, concurrency: int, logdir: Path):
    port = loadgen.free_port()
    cmd = ["serve", "--pp", str(pp), "--threads", str(threads), "--port", str(port)]
    t = time.perf_counter()
    with loadgen.start(cmd, port, logdir / f"serve_pp{pp}.log", timeout=300) as (url, _):
        startup = time.perf_counter() - t

        async def send(c, ids, t0, res):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_tokens": max_new, "ignore_eos": True},
            }
            await loadgen.stream_generate(c, url, body, t0, res)

        warm = loadgen.make_prompts(2, seed=999)
        asyncio.run(loadgen.run_level(warm, 8, 2, send))
        load0 = loadgen.loadavg()
        results, wall = asyncio.run(loadgen.run_level(prompts, max_new, concurrency, send))
    lvl = loadgen.LevelResult(concurrency, results, wall)
    return lvl, startup, load0, loadgen.loadavg()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--skip-b", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench/results/pp.md"))
    args = ap.parse_args()
    lines = [
        "# Pipeline parallelism: slot-loop overhead and PP = 2 vs PP = 1",
        "",
        f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), "
        f"Python {platform.python_version()}; shared with other jobs (load average 1/5/15 min at "
        f"start: {loadgen.loadavg()}).",
        "",
    ]

    if not args.skip_a:
        rows = [
            "| PP | rank | median µs/iteration | p99 µs/iteration | wall µs/iteration | forwards | "
            "payload bytes sent |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        summary = []
        la = loadgen.loadavg()
        for size in (1, 2, 4):
            res = bench_loop(size, args.warmup, args.iters)
            for rank, med, p99, wall, fw, nbytes in res:
                rows.append(
                    f"| {size} | {rank} | {med * 1e6:.0f} | {p99 * 1e6:.0f} | {wall * 1e6:.0f} | "
                    f"{fw} | {nbytes} |"
                )
            summary.append((size, max(r[1] for r in res), max(r[3] for r in res)))
            print(rows[-len(res) :], flush=True)
        lines += [
            "## (a) Slot-loop control overhead (empty model step)",
            "",
            "Real rank processes (multiprocessing spawn), torch.distributed gloo on loopback, "
            "1 torch thread each; every rank runs `SlotLoop.iteration` on a PPComm + real "
            "Scheduler + a runner that is never called (no requests: every iteration is the meta "
            f"metronome only, no hidden states, no ring). {args.warmup} warm-up iterations, "
            f"then {args.iters} timed. PP = 4 puts 4 busy processes on 2 cores. "
            f"Load average before: {la}, after: {loadgen.loadavg()}.",
            "",
            "| PP | median µs/iteration (max over ranks) | wall µs/iteration (max over ranks) |",
            "|---:|---:|---:|",
            *[f"| {s} | {m * 1e6:.0f} | {w * 1e6:.0f} |" for s, m, w in summary],
            "",
            "Per rank:",
            "",
            *rows,
            "",
        ]

    if not args.skip_b:
        prompts = loadgen.make_prompts(args.requests, seed=1)
        n_prompt = sum(map(len, prompts))
        tmp = Path(tempfile.mkdtemp(prefix="bench_pp_"))
        rows = [
            "| config | processes x threads | requests | concurrency | output tokens | seconds | "
            "output tok/s | mean TTFT s | p50 TTFT s | max TTFT s | mean ITL ms | errors | node "
            "start s | load avg before/after |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        rates = {}
        for pp, threads in ((1, 2), (2, 1)):
            lvl, startup, l0, l1 = bench_node(
                pp, threads, prompts, args.max_tokens, args.concurrency, tmp
            )
            rates[pp] = lvl.out_tokens / lvl.wall
            rows.append(
                f"| PP {pp} | {pp} x {threads} | {len(prompts)} | {args.concurrency} | "
                f"{lvl.out_tokens} | {lvl.wall:.1f} | {rates[pp]:.1f} | "
                f"{loadgen.fmt(lvl.stat('ttft'), 1, 2)} | "
                f"{loadgen.fmt(lvl.stat('ttft', 0.5), 1, 2)} | "
                f"{loadgen.fmt(lvl.stat('ttft', 1.0), 1, 2)} | "
                f"{loadgen.fmt(lvl.stat('itl'), 1e3, 0)} | {lvl.errors} | {startup:.0f} | {l0} / "
                f"{l1} |"
            )
            print(rows[-1], flush=True)
            for r in lvl.results:
                if r.error:
                    print("  error:", r.error, flush=True)
        lines += [
            "## (b) PP = 2 vs PP = 1, same total threads (SmolLM2-135M-Instruct, fp32)",
            "",
            "`pdserve serve --pp N --threads T` (defaults otherwise: page 16, chunk 512, "
            "max batch tokens 2048, prefix cache on; prompts are random so nothing is shared), "
            f"{len(prompts)} requests of seeded random token ids, 100-250 tokens ({n_prompt} "
            f"prompt tokens), {args.max_tokens} output tokens, ignore_eos, "
            f"all sent at once (concurrency {args.concurrency}) to POST /generate with `stream: "
            "true`; TTFT and ITL measured by the client from the SSE token lines. "
            f"One warm-up pair of requests before timing. Node logs: {tmp}.",
            "",
            *rows,
            "",
            f"PP 2 / PP 1 output throughput: **{rates[2] / rates[1]:.2f}x**.",
            "",
        ]
    lines.append(f"Load average at the end: {loadgen.loadavg()}.")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
