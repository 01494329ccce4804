"""Conditional disaggregation: where a decode-only prefill beats the PD pair (SmolLM2-135M-Instruct,
the model's own dtype), to set the router's --disagg-* defaults (router/routing/disagg.py).

A prefill node and a decode node (PP 1 each), driven the way the router drives them: the PD path
sends the same body to both nodes at once (a random bootstrap_room), the decode-only path sends it
to the decode node alone, without bootstrap fields. Both paths alternate request by request, so
the machine's other load falls on both alike.

  1. Idle TTFT by prompt length: the crossover where the transfer stops costing more than it saves.
  2. Running streams: `--streams` requests decode 96 tokens each while prompts of one length
     arrive every 0.4 s by one path; the streams' inter-token latency (p50/p99) shows what a
     decode-side prefill costs the requests already decoding.

  .venv/bin/python bench/bench_conditional.py [--lengths 8,16,32,64,128,256] [--reps 6]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import loadgen  # noqa: E402


class Paths:
    """The two ways the router can send a request."""

    def __init__(self, purl: str, durl: str, bport: int):
        self.purl, self.durl, self.bport = purl, durl, bport

    async def send(self, c, path: str, ids, max_new: int, res: loadgen.ReqResult) -> None:
        body = {"input_ids": ids, "sampling_params": {"max_tokens": max_new, "ignore_eos": True}}
        t0 = time.perf_counter()
        if path == "local":
            await loadgen.stream_generate(c, self.durl, body, t0, res)
            return
        body.update(
            bootstrap_room=random.getrandbits(63),
            bootstrap_host="127.0.0.1",
            bootstrap_port=self.bport,
        )
        p, _ = await asyncio.gather(
            c.post(f"{self.purl}/generate", json=body),
            loadgen.stream_generate(c, self.durl, body, t0, res),
        )
        if p.status_code != 200:
            res.error = res.error or f"prefill: HTTP {p.status_code}"


def prompt(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


async def idle_ttft(paths: Paths, lengths, reps: int) -> dict[tuple[int, str], list[float]]:
    rng, out = random.Random(1), {}
    async with httpx.AsyncClient(timeout=120) as c:
        for n in lengths:
            for i in range(2 * reps):
                path = ("pd", "local")[i % 2]
                res = loadgen.ReqResult()
                await paths.send(c, path, prompt(n, rng), 4, res)
                assert res.error is None, res.error
                out.setdefault((n, path), []).append(res.ttft)
    return out


async def under_streams(paths: Paths, n: int, path: str, streams: int) -> dict[str, float]:
    """`streams` long requests decode (PD path) while prompts of `n` tokens arrive by `path`."""
    rng = random.Random(2)
    async with httpx.AsyncClient(timeout=300) as c:
        bg = [loadgen.ReqResult() for _ in range(streams)]
        tasks = [asyncio.create_task(paths.send(c, "pd", prompt(64, rng), 96, r)) for r in bg]
        await asyncio.sleep(1.0)
        fg = []
        while not all(t.done() for t in tasks) and len(fg) < 40:
            r = loadgen.ReqResult()
            fg.append((r, asyncio.create_task(paths.send(c, path, prompt(n, rng), 4, r))))
            await asyncio.sleep(0.4)
        await asyncio.gather(*tasks, *(t for _, t in fg))
    errors = [r.error for r in bg + [r for r, _ in fg] if r.error]
    for e in sorted(set(errors)):
        print("    error:", e, flush=True)
    # gaps between token deliveries (the tokens of one chunk arrive together)
    gaps = sorted(b - a for r in bg for a, b in zip(r.times, r.times[1:], strict=False) if b > a)
    ttfts = sorted(r.ttft for r, _ in fg if r.error is None)
    return {
        "itl_p50": gaps[len(gaps) // 2],
        "itl_p99": gaps[int(0.99 * len(gaps))],
        "ttft_p50": ttfts[len(ttfts) // 2],
        "arrivals": len(fg),
        "errors": len(errors),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="8,16,32,64,128,256")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-lengths", default="32,256")
    ap.add_argument("--out", default=str(ROOT / "bench/results/conditional.md"))
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    logdir = Path(tempfile.mkdtemp(prefix="bench_cond_"))
    load0, t_all = loadgen.loadavg(), time.perf_counter()
    with contextlib.ExitStack() as st:
        pair = loadgen.start_pd_pair(st, logdir)
        purl, durl, bport = pair.purl, pair.durl, pair.bport
        httpx.put(
            f"{durl}/bootstrap_servers", json={"servers": [f"127.0.0.1:{bport}"]}, timeout=10
        ).raise_for_status()
        paths = Paths(purl, durl, bport)
        asyncio.run(idle_ttft(paths, [16], 1))  # warm-up, both paths
        ttft = asyncio.run(idle_ttft(paths, lengths, args.reps))
        print({k: round(statistics.median(v) * 1e3, 1) for k, v in ttft.items()}, flush=True)
        mixed = {
            (n, path): asyncio.run(under_streams(paths, n, path, args.streams))
            for n in (int(x) for x in args.stream_lengths.split(","))
            for path in ("pd", "local")
        }
    med = {k: statistics.median(v) for k, v in ttft.items()}
    rows = [
        "| prompt tokens | PD TTFT p50 ms | decode-only TTFT p50 ms | decode-only / PD |",
        "|---:|---:|---:|---:|",
    ]
    for n in lengths:
        pd, lo = med[(n, "pd")], med[(n, "local")]
        rows.append(f"| {n} | {pd * 1e3:.1f} | {lo * 1e3:.1f} | {lo / pd:.2f} |")
    mrows = [
        "| arriving prompt tokens | arrivals by | arrivals | their TTFT p50 ms "
        "| streams' ITL p50 ms | streams' ITL p99 ms | errors |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for (n, path), m in mixed.items():
        mrows.append(
            f"| {n} | {'PD pair' if path == 'pd' else 'decode only'} | {m['arrivals']} | "
            f"{m['ttft_p50'] * 1e3:.1f} | {m['itl_p50'] * 1e3:.1f} | {m['itl_p99'] * 1e3:.1f} | "
            f"{m['errors']} |"
        )
    text = "\n".join(
        [
            "# Conditional disaggregation: PD pair vs decode-only prefill (SmolLM2-135M-Instruct)",
            "",
            f"Machine: {os.cpu_count()} CPUs ({platform.machine()}); load average at start "
            f"{load0}, at the end {loadgen.loadavg()}; whole script "
            f"{time.perf_counter() - t_all:.0f} s. `pdserve prefill` + `pdserve decode` (PP 1 "
            "each, default dtype, one core each: `--cpus 0` and `--cpus 1`), driven like the "
            "router; the two paths alternate "
            "request by request. Node logs: " + str(logdir) + ".",
            "",
            f"## Idle TTFT ({args.reps} requests per path and length, 4 output tokens)",
            "",
            *rows,
            "",
            f"## {args.streams} decoding streams (96 tokens each), prompts arriving every 0.4 s",
            "",
            *mrows,
            "",
            f"Command: `.venv/bin/python bench/bench_conditional.py --lengths {args.lengths} "
            f"--reps {args.reps} --streams {args.streams} --stream-lengths {args.stream_lengths}`",
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
