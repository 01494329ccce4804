"""PD disaggregation vs a colocated node with the same number of rank processes
(SmolLM2-135M-Instruct, fp32).

  PD:        `pdserve prefill --pp 2 --threads 1` + `pdserve decode --pp 2 --threads 1` (4 rank
             processes), driven like the router (tests/pd_cluster.py `pd_generate`): the same
             request with a random 63-bit bootstrap_room to both nodes at once, the decode node's
             /generate streamed (SSE).
  colocated: `pdserve serve --pp 4 --threads 1` (4 rank processes), /generate streamed.
Workload per concurrency level: seeded random token-id prompts of 100-250 tokens, 64 output tokens,
ignore_eos (fresh prompts per level, the same for both systems). TTFT = send -> first streamed
token, ITL = per request (last token - first token) / (tokens - 1), throughput = output tokens /
wall. Queues: every node's GET /server_info ranks[0] is sampled every 100 ms (mean occupancy); if a
node exports pdserve_queue_time_seconds on /metrics,
the mean time per queue is taken from it as well.

  .venv/bin/python bench/bench_pd.py [--levels 1:4,8:16,32:32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import loadgen  # noqa: E402
from cluster import wait_healthy  # noqa: E402


def run_levels(nodes: dict[str, str], send, levels, max_new: int) -> list[loadgen.LevelResult]:
    out = []
    for conc, n in levels:
        prompts = loadgen.make_prompts(n, seed=100 + conc)
        before = {name: loadgen.queue_time_counters(u) for name, u in nodes.items()}

        async def go(prompts, conc):
            sampler = loadgen.QueueSampler(nodes, 0.1)
            sampler.start()
            res, wall = await loadgen.run_level(prompts, max_new, conc, send)
            return res, wall, await sampler.stop()

        res, wall, occ = asyncio.run(go(prompts, conc))
        qt = {
            name: loadgen.queue_time_delta(before[name], loadgen.queue_time_counters(u))
            for name, u in nodes.items()
        }
        lvl = loadgen.LevelResult(conc, res, wall, occ, qt)
        out.append(lvl)
        print(
            f"  concurrency {conc}: {lvl.out_tokens} tokens in {wall:.1f} s = "
            f"{lvl.out_tokens / wall:.1f} tok/s, TTFT {lvl.stat('ttft'):.2f} s, "
            f"ITL {lvl.stat('itl') * 1e3:.0f} ms, errors {lvl.errors}, load {loadgen.loadavg()}",
            flush=True,
        )
        for r in res:
            if r.error:
                print("    error:", r.error, flush=True)
    return out


def run_pd(levels, max_new: int, logdir: Path, threads: int):
    pport, bport, dport = loadgen.free_port(), loadgen.free_port(), loadgen.free_port()
    common = ["--threads", str(threads)]
    t = time.perf_counter()
    with contextlib.ExitStack() as st:
        purl, pp = st.enter_context(
            loadgen.start(
                [
                    "prefill",
                    "--pp",
                    "2",
                    "--port",
                    str(pport),
                    "--bootstrap-port",
                    str(bport),
                    *common,
                ],
                pport,
                logdir / "prefill.log",
                wait=False,
            )
        )
        durl, dp = st.enter_context(
            loadgen.start(
                ["decode", "--pp", "2", "--port", str(dport), *common],
                dport,
                logdir / "decode.log",
                wait=False,
            )
        )
        wait_healthy(purl, pp, 300, logdir / "prefill.log")
        wait_healthy(durl, dp, 300, logdir / "decode.log")
        startup = time.perf_counter() - t
        # this script plays the router: it tells the decode node the one bootstrap server it may
        # contact
        httpx.put(
            f"{durl}/bootstrap_servers", json={"servers": [f"127.0.0.1:{bport}"]}, timeout=10
        ).raise_for_status()

        async def send(c, ids, t0, res):
            room = random.getrandbits(63)
            b = {
                "input_ids": ids,
                "bootstrap_room": room,
                "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bport,
                "sampling_params": {"max_tokens": max_new, "ignore_eos": True},
            }
            p, _ = await asyncio.gather(
                c.post(f"{purl}/generate", json=b), loadgen.stream_generate(c, durl, b, t0, res)
            )
            if p.status_code != 200 or "error" in p.json():
                res.error = res.error or f"prefill: HTTP {p.status_code} {p.text[:200]}"

        asyncio.run(loadgen.run_level(loadgen.make_prompts(2, seed=999), 8, 2, send))  # warm-up
        return run_levels({"prefill": purl, "decode": durl}, send, levels, max_new), startup


def run_colocated(levels, max_new: int, logdir: Path, threads: int):
    port = loadgen.free_port()
    t = time.perf_counter()
    with loadgen.start(
        ["serve", "--pp", "4", "--threads", str(threads), "--port", str(port)],
        port,
        logdir / "colocated.log",
        timeout=300,
    ) as (url, _):
        startup = time.perf_counter() - t

        async def send(c, ids, t0, res):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_tokens": max_new, "ignore_eos": True},
            }
            await loadgen.stream_generate(c, url, body, t0, res)

        asyncio.run(loadgen.run_level(loadgen.make_prompts(2, seed=999), 8, 2, send))  # warm-up
        return run_levels({"colocated": url}, send, levels, max_new), startup


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1:4,8:16,32:32", help="concurrency:requests,...")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank process")
    ap.add_argument("--out", default=str(ROOT / "bench/results/pd.md"))
    args = ap.parse_args()
    levels = [tuple(int(x) for x in lv.split(":")) for lv in args.levels.split(",")]
    logdir = Path(tempfile.mkdtemp(prefix="bench_pd_"))
    load0 = loadgen.loadavg()
    t_all = time.perf_counter()
    print("PD: prefill PP 2 + decode PP 2", flush=True)
    pd, pd_start = run_pd(levels, args.max_tokens, logdir, args.threads)
    print("colocated: PP 4", flush=True)
    co, co_start = run_colocated(levels, args.max_tokens, logdir, args.threads)

    rows = [
        "| system | concurrency | requests | output tokens | seconds | output tok/s | mean TTFT s "
        "| p50 TTFT s | p99 TTFT s | mean ITL ms | p50 ITL ms | p99 ITL ms | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    f = loadgen.fmt
    for name, res in (("PD (P: PP 2, D: PP 2)", pd), ("colocated PP 4", co)):
        for lv in res:
            rows.append(
                f"| {name} | {lv.concurrency} | {len(lv.results)} | {lv.out_tokens} | "
                f"{lv.wall:.1f} | {lv.out_tokens / lv.wall:.1f} | {f(lv.stat('ttft'), 1, 2)} | "
                f"{f(lv.stat('ttft', 0.5), 1, 2)} | {f(lv.stat('ttft', 0.99), 1, 2)} | "
                f"{f(lv.stat('itl'), 1e3)} | {f(lv.stat('itl', 0.5), 1e3)} | "
                f"{f(lv.stat('itl', 0.99), 1e3)} | {lv.errors} |"
            )
    qrows = [
        "| system | concurrency | node | samples | "
        + " | ".join(
            f"{q}" for q in ("bootstrap", "prealloc", "transfer", "waiting", "running", "inflight")
        )
        + " |",
        "|---|---:|---|---:|" + "---:|" * 6,
    ]
    trows = [
        "| system | concurrency | node | queue | mean occupancy | Little's-law mean time s |",
        "|---|---:|---|---|---:|---:|",
    ]
    have_qt = False
    for name, res in (("PD", pd), ("colocated", co)):
        for lv in res:
            for node, occ in lv.queues.items():
                cells = [
                    f"{occ[q]:.2f}" if q in occ else "-"
                    for q in ("bootstrap", "prealloc", "transfer", "waiting", "running", "inflight")
                ]
                qrows.append(
                    f"| {name} | {lv.concurrency} | {node} | {occ.get('_n', 0)} | "
                    + " | ".join(cells)
                    + " |"
                )
                for q, v in occ.items():
                    if q == "_n":
                        continue
                    # Little's law: mean time in queue = mean occupancy x wall / requests through it
                    trows.append(
                        f"| {name} | {lv.concurrency} | {node} | {q} | {v:.2f} | "
                        f"{v * lv.wall / len(lv.results):.2f} |"
                    )
                if lv.queue_times.get(node):
                    have_qt = True
    qt_note = (
        (
            "Nodes export no `pdserve_queue_time_seconds` on /metrics in this build, "
            "so per-request queue times are not available; below is the mean queue occupancy at "
            "PP0 sampled every 100 ms from GET /server_info (the ranks push stats every 0.5 s, "
            "so samples repeat), and a Little's-law estimate of the mean time per request in each "
            "queue = occupancy x wall / requests."
        )
        if not have_qt
        else "Mean time per queue from `pdserve_queue_time_seconds` (delta over the level): "
        + "; ".join(
            f"{n} c={lv.concurrency} {nd}: " + ", ".join(f"{q} {v:.3f} s" for q, v in qt.items())
            for n, res in (("PD", pd), ("colocated", co))
            for lv in res
            for nd, qt in lv.queue_times.items()
            if qt
        )
    )
    text = "\n".join(
        [
            "# PD disaggregation vs colocated (SmolLM2-135M-Instruct, fp32)",
            "",
            f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), "
            f"Python {platform.python_version()}; load generator, all node fronts and rank "
            f"processes share it with other jobs. Load average 1/5/15 min at start {load0}, "
            f"at the end {loadgen.loadavg()}. Whole script: {time.perf_counter() - t_all:.0f} s.",
            "",
            f"PD: `pdserve prefill --pp 2 --threads {args.threads}` + `pdserve decode --pp 2 "
            f"--threads {args.threads}` (started in {pd_start:.0f} s), "
            "driven like the router (tests/pd_cluster.py `pd_generate`: "
            "same body with a random bootstrap_room to both nodes at once), "
            "decode /generate streamed. Colocated: `pdserve serve --pp 4 --threads "
            f"{args.threads}` (started in {co_start:.0f} s). Both: "
            f"4 rank processes x {args.threads} thread on 2 cores, default engine settings (page "
            "16, chunk 512, KV transfer over Mooncake TCP on loopback for PD).",
            "",
            "Workload per level: seeded random token-id prompts of 100-250 tokens, "
            f"{args.max_tokens} output tokens, ignore_eos; a closed loop with `concurrency` "
            "requests in flight; fresh prompts per level (no prefix-cache hits), "
            "the same prompts for both systems. One warm-up pair before the first level. "
            "TTFT = send to first streamed token (client side), ITL = per request (last - first "
            "token) / (tokens - 1), throughput = output tokens / wall of the level. Node logs: "
            + str(logdir)
            + ".",
            "",
            *rows,
            "",
            "## Queues",
            "",
            qt_note,
            "",
            *qrows,
            "",
            *trows,
            "",
            f"Command: `.venv/bin/python bench/bench_pd.py --levels {args.levels} --max-tokens "
            f"{args.max_tokens}`",
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
