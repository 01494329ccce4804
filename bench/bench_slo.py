"""SLO admission and tenant fairness under overload (issue #45): what do they buy?

Each experiment starts `pdserve up` clusters of its own (its defaults, plus the args named),
all in one run, so that ratios compare like with like:

  overload  Capacity on a cluster without SLO (closed loop: `--concurrency` streamed chat requests
            at a time, `--capacity-requests` in all; completed / wall seconds), then Poisson
            arrivals at `--overload` x capacity for `--duration` s, the same times and prompts
            (distinct, 150 to 400 words, 32 output tokens) to that cluster and to one with
            `--router-args "--ttft-slo-ms S --itl-slo-ms I"`. Goodput: requests answered 200 with
            TTFT <= S and mean ITL <= I, per second of the arrival window; also how fast the 429s
            came and whether each was typed (`slo_unattainable` with a Retry-After header).
  fairness  Tenant B (token `tenant-b`) streams `--victim-requests` short requests 2 at a time,
            alone and while tenant A (`tenant-a`) floods long prompts 16 at a time; on one
            cluster per entry of `--fairness-clusters` (`pdserve up` args, ';'-separated; by
            default its defaults, and `--router-args "--max-queued-prompt-tokens T"`). B's TTFT
            and ITL, B's TTFT p99 with A over B alone, and what A got (completed per second of
            B's run: the flood's own throughput). With `--peer-url URL`, first against that
            server too (vLLM-CPU, bench/peers/start_vllm.sh), for a side-by-side.

Every cluster it starts is stopped, also on Ctrl-C or SIGTERM. Writes `--out` and prints it.

    .venv/bin/python bench/bench_slo.py [--experiments overload,fairness] [--model PATH]
        [--duration 60] [--overload 2.0] [--ttft-slo-ms 3000] [--itl-slo-ms 500]
        [--max-queued-prompt-tokens 2048] [--fairness-clusters "ARGS;ARGS"] [--seed 0]
        [--out bench/results/slo.md]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import itertools
import json
import os
import platform
import random
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import start_cluster, stop_cluster, wait_ready  # noqa: E402

STRAGGLER_S = 120.0  # open loop: what still runs this long after the arrival window is cut
VICTIM_CONC, FLOOD_CONC, FLOOD_WORDS, FLOOD_HEAD_START_S = 2, 16, 900, 2.0
REJ = "pdserve_router_slo_rejections_total"
METRICS = (("goodput", "pdserve_router_goodput_requests_total", ""), ("slo_rejections", REJ, ""),
           ("ttft_rejections", REJ, 'slo="ttft"'))  # fmt: skip
# fmt: off
WORDS = [
    "river", "stone", "light", "cloud", "garden", "window", "paper", "engine", "market", "winter",
    "silver", "forest", "letter", "bridge", "music", "ocean", "table", "candle", "mirror", "field",
    "harbor", "signal", "valley", "planet", "circle", "number", "yellow", "orange", "summer",
    "thunder", "castle", "pencil", "basket", "anchor", "meadow", "rocket", "violin", "island",
]
# fmt: on


def chat(model: str, serial: int, n_words: int, max_tokens: int, seed: int) -> dict:
    """A streamed chat request of random words, its serial number first: no prefix cache hit."""
    rng = random.Random(f"{seed}:{serial}")
    text = f"Request {serial}. Summarise in one line: " + " ".join(rng.choices(WORDS, k=n_words))
    return {"model": model, "messages": [{"role": "user", "content": text}], "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}  # fmt: skip


def new_rec() -> dict:
    return {"status": None, "done": False, "ttft": None, "gaps": [], "refusal_s": None,
            "typed": False, "error": None}  # fmt: skip


def outcome(rec: dict) -> str:
    """completed, 429, or what else happened (an exception's name, cut, a status)."""
    if rec["status"] == 200 and rec["done"] and rec["ttft"] is not None:
        return "completed"
    if rec["status"] == 429:
        return "429"
    return rec["error"] or ("200 unfinished" if rec["status"] == 200 else str(rec["status"]))


async def stream_one(client: httpx.AsyncClient, body: dict, rec: dict, token: str = "") -> None:
    """One request into `rec`: status, TTFT, gaps between content chunks; for a refusal the time
    to it and whether it was typed."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    t0, last = time.perf_counter(), None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                rec["refusal_s"] = time.perf_counter() - t0
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    code = json.loads(await r.aread())["error"]["code"]
                    rec["typed"] = code == "slo_unattainable" and "retry-after" in r.headers
                return
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    rec["done"] = True
                    return
                chunk = json.loads(line[6:]) if line.startswith("data: ") else {}
                if "error" in chunk:
                    rec["error"] = "stream error"
                    return
                if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                    now = time.perf_counter()
                    if last is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["gaps"].append(now - last)
                    last = now
    except (httpx.HTTPError, ValueError) as e:
        rec["error"] = type(e).__name__


async def closed_loop(client, model: str, args, specs: list, conc: int, token="") -> list[dict]:
    """`specs` ((serial, prompt words) each) streamed `conc` at a time, 32 output tokens."""
    sem, recs = asyncio.Semaphore(conc), [new_rec() for _ in specs]

    async def one(rec: dict, serial: int, n_words: int) -> None:
        async with sem:
            await stream_one(client, chat(model, serial, n_words, 32, args.seed), rec, token)

    await asyncio.gather(*(one(rec, *spec) for rec, spec in zip(recs, specs, strict=True)))
    return recs


@contextlib.asynccontextmanager
async def connect(url: str, args, meta: dict):
    """A client (300 s timeout, no connection cap) and the model, after a short warm-up."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(300, connect=30)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        meta.setdefault("model", model)
        await closed_loop(client, model, args, [(900_000 + i, 150) for i in range(4)], 2)
        yield client, model


async def counters(client: httpx.AsyncClient) -> dict:
    """The router's goodput and SLO-rejection counters (those it has)."""
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    out = {}
    for key, name, label in METRICS:
        lines = [ln for ln in text.splitlines() if ln.startswith((name + "{", name + " "))]
        if vals := [float(ln.rsplit(None, 1)[-1]) for ln in lines if label in ln]:
            out[key] = sum(vals)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


@contextlib.contextmanager
def cluster(args, router_args: str, up_args: str = ""):
    """`pdserve up` (its defaults, `--model` if given, `router_args`, then `up_args`): yields its
    URL, and stops it on the way out, whatever happened; a second Ctrl-C does not cut the stop
    short."""
    from pdserve.infra.procs import free_port

    port = free_port()
    cmd = [f"--router-args={router_args}"] if router_args else []
    cmd += shlex.split(up_args)
    cmd += ["--model", args.model] if args.model else []
    log = Path(tempfile.mkdtemp(prefix="pdserve-slo-")) / "up.log"
    print(f"[slo] pdserve up --router-args={router_args!r} {up_args} (log {log})", flush=True)
    proc = None
    try:
        proc = start_cluster(port, cmd, log)
        wait_ready(proc, log, args.startup_timeout)
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc is not None:
            held = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                if left := stop_cluster(proc):
                    print(f"[slo] still alive after Ctrl-C to pdserve up, killed: {left}")
            finally:
                for sig, handler in held.items():
                    signal.signal(sig, handler)


async def open_loop(client: httpx.AsyncClient, model: str, plan: list, args) -> dict:
    """Sends `plan` ((second, prompt words) each); cuts what runs STRAGGLER_S past the window.
    The records and the growth of the router's counters."""
    recs, before = [new_rec() for _ in plan], await counters(client)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + plan[i][0] - time.perf_counter()))
        await stream_one(client, chat(model, i, plan[i][1], 32, args.seed), recs[i])

    tasks = [asyncio.create_task(one(i)) for i in range(len(plan))]
    _, pending = await asyncio.wait(tasks, timeout=args.duration + STRAGGLER_S)
    for rec, task in zip(recs, tasks, strict=True):
        if task in pending:
            task.cancel()
            rec["error"] = "cut"
    await asyncio.gather(*pending, return_exceptions=True)
    after = await counters(client)
    grown = {k: v - before.get(k, 0) for k, v in after.items()}
    return {"recs": recs, "router": grown}


async def overload_run(url: str, args, meta: dict, plan: list | None = None) -> dict:
    """On one cluster: capacity and the arrival plan first where none is given, then the plan."""
    async with connect(url, args, meta) as (client, model):
        if plan is not None:
            return await open_loop(client, model, plan, args)
        rng = random.Random(args.seed)
        specs = [(800_000 + i, rng.randint(150, 400)) for i in range(args.capacity_requests)]
        t0 = time.perf_counter()
        recs = await closed_loop(client, model, args, specs, args.concurrency)
        cap = sum(outcome(r) == "completed" for r in recs) / (time.perf_counter() - t0)
        plan, t = [], rng.expovariate(cap * args.overload) if cap else args.duration
        while t < args.duration:
            plan.append((t, rng.randint(150, 400)))
            t += rng.expovariate(cap * args.overload)
        print(f"[slo] capacity {cap:.2f} req/s; {len(plan)} arrivals", flush=True)
        if not plan:
            raise RuntimeError(f"no arrival to send (capacity {cap:.2f} req/s)")
        return {"capacity": cap, "plan": plan} | await open_loop(client, model, plan, args)


def overload(args, meta: dict) -> dict:
    with cluster(args, "") as url:
        plain = asyncio.run(overload_run(url, args, meta))
    flags = f"--ttft-slo-ms {args.ttft_slo_ms:g} --itl-slo-ms {args.itl_slo_ms:g}"
    with cluster(args, flags) as url:
        slo = asyncio.run(overload_run(url, args, meta, plain["plan"]))
    return {"capacity": plain["capacity"], "arrivals": len(plain["plan"]),
            "runs": {"(none)": plain, flags: slo}}  # fmt: skip


def overload_row(name: str, run: dict, args) -> tuple[float, str]:
    recs, s, i = run["recs"], args.ttft_slo_ms / 1e3, args.itl_slo_ms / 1e3
    ok = [r for r in recs if outcome(r) == "completed"]
    good = [r for r in ok if r["ttft"] <= s and sum(r["gaps"]) / max(1, len(r["gaps"])) <= i]
    no = [r for r in recs if outcome(r) == "429"]
    other = collections.Counter(o for o in map(outcome, recs) if o not in ("completed", "429"))
    ttft, lat = [r["ttft"] * 1e3 for r in ok], [r["refusal_s"] * 1e3 for r in no]
    goodput = len(good) / args.duration
    cells = [name, f"{goodput:.2f}", len(ok), len(no),
             ", ".join(f"{k}: {v}" for k, v in sorted(other.items())) or "0",
             f"{pct(ttft, 0.5):.0f} / {pct(ttft, 0.99):.0f}",
             f"{pct(lat, 0.5):.0f} / {pct(lat, 0.99):.0f} / {max(lat):.0f}" if lat else "-",
             f"{sum(r['typed'] for r in no)}/{len(no)}" if no else "-",
             ", ".join(f"{k} {v:g}" for k, v in run["router"].items()) or "-"]  # fmt: skip
    return goodput, "| " + " | ".join(map(str, cells)) + " |"


def overload_table(res: dict, args) -> list[str]:
    lines = [
        "## Goodput under overload, with and without SLO admission",
        "",
        f"Capacity {res['capacity']:.2f} req/s (closed loop, {args.concurrency} at a time, "
        f"{args.capacity_requests} requests); offered {args.overload:g}x that: "
        f"{res['arrivals']} Poisson arrivals in {args.duration:g} s, the same to both clusters. "
        f"Goodput: completed with TTFT <= {args.ttft_slo_ms:g} ms and mean ITL <= "
        f"{args.itl_slo_ms:g} ms, per second of the window. Other: neither completed nor 429 "
        f"(cut: still running {STRAGGLER_S:g} s after the window).",
        "",
        "| router args | goodput (req/s) | 200 completed | 429 | other | TTFT p50 / p99 (ms) "
        "| 429 latency p50 / p99 / max (ms) | typed 429s | router counters (growth) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    goodput = []
    for name, run in res["runs"].items():
        g, row = overload_row(name, run, args)
        goodput.append(g)
        lines.append(row)
    ratio = goodput[1] / goodput[0] if goodput[0] else float("inf")
    return lines + ["", f"Goodput with SLO admission / without: {ratio:.2f}x.", ""]


async def flooder(client: httpx.AsyncClient, model: str, args, stop: asyncio.Event) -> dict:
    """Tenant A: long distinct prompts, FLOOD_CONC at a time, until `stop`; what it got."""
    got, serial = collections.Counter(), itertools.count(500_000)

    async def loop() -> None:
        while not stop.is_set():
            rec = new_rec()
            body = chat(model, next(serial), FLOOD_WORDS, 16, args.seed)
            try:
                await stream_one(client, body, rec, "tenant-a")
            except asyncio.CancelledError:
                got["cut at the end"] += 1
                raise
            got[outcome(rec)] += 1
            if outcome(rec) != "completed":
                await asyncio.sleep(0.2)  # no busy loop on refusals

    workers = [asyncio.create_task(loop()) for _ in range(FLOOD_CONC)]
    await stop.wait()
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    return dict(got)


async def fairness_pair(url: str, args, meta: dict) -> dict:
    """On one cluster: tenant B alone, then B while A floods."""
    async with connect(url, args, meta) as (client, model):
        specs = [[(100_000 * c + i, 150) for i in range(args.victim_requests)] for c in (1, 2)]
        alone = await closed_loop(client, model, args, specs[0], VICTIM_CONC, "tenant-b")
        stop = asyncio.Event()
        flood = asyncio.create_task(flooder(client, model, args, stop))
        await asyncio.sleep(FLOOD_HEAD_START_S)  # the flood is under way
        t0 = time.perf_counter()
        with_a = await closed_loop(client, model, args, specs[1], VICTIM_CONC, "tenant-b")
        seconds = time.perf_counter() - t0
        stop.set()
        got = await flood
        got["completed per s"] = round(got.get("completed", 0) / seconds, 2)
        return {"B alone": (alone, {}), "B with A": (with_a, got)}


def fairness(args, meta: dict) -> dict:
    out = {}
    if args.peer_url:  # a server started outside (bench/peers/start_vllm.sh): first, the same run
        out[f"peer at {args.peer_url}"] = asyncio.run(fairness_pair(args.peer_url, args, meta))
    sets = args.fairness_clusters
    if sets is None:
        sets = f";--router-args='--max-queued-prompt-tokens {args.max_queued_prompt_tokens}'"
    for flags in [] if sets == "none" else sets.split(";"):
        with cluster(args, "", flags) as url:
            out[flags or "(defaults)"] = asyncio.run(fairness_pair(url, args, meta))
    return out


def fairness_table(res: dict, args) -> list[str]:
    lines = [
        "## Tenant fairness: a flooder (A) and a victim (B)",
        "",
        f"B: {args.victim_requests} streamed chat requests, {VICTIM_CONC} at a time, prompts of "
        f"150 words, 32 output tokens. A: prompts of {FLOOD_WORDS} words, 16 output tokens, "
        f"{FLOOD_CONC} at a time, from {FLOOD_HEAD_START_S:g} s before B starts until B is done "
        "(what is in flight then is cut). One cluster per row's args.",
        "",
        "| pdserve up args | condition | B TTFT p50 (ms) | B TTFT p99 (ms) | B ITL p99 (ms) "
        "| B completed | what A got |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios, p99 = [], {}
    for flags, conds in res.items():
        for cond, (recs, got) in conds.items():
            ttft = [r["ttft"] * 1e3 for r in recs if r["ttft"] is not None]
            itl = [g * 1e3 for r in recs for g in r["gaps"]]
            p99[cond] = pct(ttft, 0.99)
            done = sum(outcome(r) == "completed" for r in recs)
            a = ", ".join(f"{k}: {v}" for k, v in sorted(got.items())) or "-"
            lines.append(f"| {flags} | {cond} | {pct(ttft, 0.5):.0f} | {p99[cond]:.0f} | "
                         f"{pct(itl, 0.99):.0f} | {done}/{len(recs)} | {a} |")  # fmt: skip
        ratios.append(f"| {flags} | {p99['B with A'] / p99['B alone']:.2f}x |")
    return lines + ["", "| pdserve up args | B TTFT p99 with A / alone |", "|---|---|", *ratios, ""]


def report(results: dict, meta: dict, args) -> str:
    shown = {k: ",".join(v) if isinstance(v, list) else v for k, v in vars(args).items()}
    settings = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in shown.items() if v is not None)
    lines = [
        "# SLO admission and tenant fairness (bench/bench_slo.py, issue #45)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}; machine: {platform.processor() or platform.machine()}"
        f" ({os.cpu_count()} cores); model: {meta.get('model', '?')}; `pdserve up` at its "
        "defaults plus the args shown.",
        "",
        f"Settings: `{settings}`",
        "",
    ]
    if "overload" in results:
        lines += overload_table(results["overload"], args)
    if "fairness" in results:
        lines += fairness_table(results["fairness"], args)
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experiments", default="overload,fairness")
    ap.add_argument("--model", default=None, help="passed to pdserve up as --model")
    ap.add_argument("--concurrency", type=int, default=16, help="capacity: closed-loop width")
    ap.add_argument("--capacity-requests", type=int, default=48)
    ap.add_argument("--overload", type=float, default=2.0, help="offered load / capacity")
    ap.add_argument("--duration", type=float, default=60.0, help="open-loop arrival window (s)")
    ap.add_argument("--ttft-slo-ms", type=float, default=3000.0)
    ap.add_argument("--itl-slo-ms", type=float, default=500.0)
    ap.add_argument("--victim-requests", type=int, default=24)
    ap.add_argument("--max-queued-prompt-tokens", type=int, default=2048)
    ap.add_argument(
        "--fairness-clusters",
        default=None,
        help="';'-separated `pdserve up` args, one fairness cluster each (default: its "
        "defaults; then --router-args='--max-queued-prompt-tokens T'; none: no cluster)",
    )
    ap.add_argument(
        "--peer-url",
        default=None,
        help="fairness: also run it against this OpenAI server (vLLM-CPU), before the clusters",
    )
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "bench/results/slo.md"))
    args = ap.parse_args()
    args.experiments = [e.strip() for e in args.experiments.split(",") if e.strip()]
    if not args.experiments or set(args.experiments) - {"overload", "fairness"}:
        ap.error("--experiments: a comma-separated subset of overload,fairness")
    return args


def main() -> int:
    args = parse_args()
    # both raise KeyboardInterrupt (asyncio.run cancels its task first); each cluster's `finally`
    # stops that cluster
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    results, meta, rc = {}, {}, 0
    try:
        for exp in args.experiments:
            results[exp] = (overload if exp == "overload" else fairness)(args, meta)
    except KeyboardInterrupt:
        print("[slo] interrupted; the clusters are stopped", flush=True)
        rc = 130
    except (RuntimeError, TimeoutError, httpx.HTTPError) as e:
        print(f"[slo] error: {e}", flush=True)
        rc = 1
    if results:  # what finished, also after an error
        text = report(results, meta, args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(text)
    return rc


if __name__ == "__main__":
    sys.exit(main())
