"""One client abuses the cluster; how much slower are the others? (issue #45, "bounded work").

Starts `pdserve up` at its defaults, then, in rounds that alternate the conditions, a *victim*
client streams chat requests at a fixed concurrency while an *abuser* runs one of:

  none         nothing (the reference)
  tokenize     /tokenize of 100 KB texts, 8 at a time, as fast as answered
  huge_prompt  completions of 4 MiB prompts, 2 at a time (each is refused past the context, after
               the node has read and tokenised it)
  schemas      chat requests with a JSON schema of their own each (distinct, about 40 KB, of a
               few hundred properties), 2 at a time, 4 output tokens
  traceparent  small chat requests, 4 at a time, all with one `traceparent`

It reports the victim's TTFT p50/p99 and ITL p99 under each condition as ratios to `none` in the
same run, and what the abuser got (status codes). By default both clients send no API key, so the
router sees one tenant; with `--tenants` they send bearer tokens of their own (`victim`,
`abuser`), two tenants, and `--router-args` can set the tenants' limits
(`--tenant-max-concurrent N`). The tests assert the bounds on work and memory
(tests/test_router_units.py, test_timeline_units.py, test_guide_gate.py); timings belong here.

    .venv/bin/python bench/bench_abuse.py [--model PATH] [--rounds 2] [--requests 24]
        [--tenants] [--router-args "..."] [--out bench/results/abuse.md]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import start_cluster, stop_cluster, up_args, wait_ready  # noqa: E402

CONDITIONS = ("none", "tokenize", "huge_prompt", "schemas", "traceparent")
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def victim_prompt(i: int) -> list[dict]:
    """A prompt no other one starts with (its number first), so no prefix cache holds it."""
    words = " ".join(f"w{(i * 7 + k) % 997}" for k in range(150))
    return [{"role": "user", "content": f"Request {i}. Summarise in one line: {words}"}]


async def victim(client: httpx.AsyncClient, model: str, n: int, conc: int, seed: int) -> dict:
    """`n` streamed chat requests, `conc` at a time: their TTFTs and gaps between tokens."""
    ttft, gaps, sem = [], [], asyncio.Semaphore(conc)

    async def one(i: int) -> None:
        body = {"model": model, "messages": victim_prompt(seed * 1000 + i), "max_tokens": 32,
                "stream": True, "ignore_eos": True, "temperature": 0}  # fmt: skip
        async with sem:
            t0, last = time.perf_counter(), None
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    if last is None:
                        ttft.append(now - t0)
                    else:
                        gaps.append(now - last)
                    last = now

    await asyncio.gather(*(one(i) for i in range(n)))
    return {"ttft": ttft, "itl": gaps}


def _schema(i: int) -> dict:
    props = {f"field_{i}_{k}": {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 8}, "b": {"type": "integer"}},
        "required": ["a", "b"]} for k in range(300)}  # fmt: skip
    return {"type": "object", "properties": props}


async def abuser(client: httpx.AsyncClient, model: str, kind: str, stop: asyncio.Event) -> dict:
    codes: collections.Counter = collections.Counter()
    serial = 0

    async def request() -> httpx.Response:
        nonlocal serial
        serial += 1
        if kind == "tokenize":
            text = f"{serial} " + "abuse " * 17000  # about 100 KB
            return await client.post("/tokenize", json={"model": model, "prompt": text})
        if kind == "huge_prompt":
            body = {"model": model, "prompt": f"{serial} " + "x" * (4 << 20), "max_tokens": 1}
            return await client.post("/v1/completions", json=body)
        msgs = [{"role": "user", "content": f"hello {serial}"}]
        body = {"model": model, "messages": msgs, "max_tokens": 4}
        if kind == "schemas":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": f"s{serial}", "schema": _schema(serial)}}  # fmt: skip
            return await client.post("/v1/chat/completions", json=body)
        headers = {"traceparent": TRACEPARENT}
        return await client.post("/v1/chat/completions", json=body, headers=headers)

    async def loop() -> None:
        while not stop.is_set():
            try:
                codes[(await request()).status_code] += 1
            except httpx.HTTPError as e:
                codes[type(e).__name__] += 1

    width = {"tokenize": 8, "huge_prompt": 2, "schemas": 2, "traceparent": 4}.get(kind, 0)
    await asyncio.gather(*(loop() for _ in range(width)))
    return dict(codes)


def bearer(args, who: str) -> dict:
    return {"Authorization": f"Bearer {who}"} if args.tenants else {}


async def run(url: str, args) -> dict:
    limits = httpx.Limits(max_connections=64)
    async with (
        httpx.AsyncClient(
            base_url=url, timeout=600, limits=limits, headers=bearer(args, "victim")
        ) as client,
        httpx.AsyncClient(
            base_url=url, timeout=600, limits=limits, headers=bearer(args, "abuser")
        ) as abuser_client,
    ):
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await victim(client, model, 4, 2, seed=999)  # warm-up
        conds = ["none", *(c for c in args.conditions.split(",") if c != "none")]
        res = {c: {"ttft": [], "itl": [], "abuser": collections.Counter()} for c in conds}
        for rnd in range(args.rounds):
            for ci, cond in enumerate(conds):
                stop = asyncio.Event()
                abuse = asyncio.create_task(abuser(abuser_client, model, cond, stop))
                await asyncio.sleep(2.0 if cond != "none" else 0)  # the abuse is under way
                # prompts of its own per round and condition: none is in a prefix cache already
                seed = 1 + rnd * len(conds) + ci
                got = await victim(client, model, args.requests, args.concurrency, seed)
                stop.set()
                res[cond]["abuser"].update(await abuse)
                res[cond]["ttft"] += got["ttft"]
                res[cond]["itl"] += got["itl"]
                p99 = pct(res[cond]["ttft"], 0.99) * 1e3
                print(f"round {rnd} {cond}: victim TTFT p99 {p99:.0f} ms", flush=True)
        return res


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def table(res: dict, args) -> str:
    base = res["none"]
    setup = f"; router args: {args.router_args}" if args.router_args else ""
    setup += "; the victim and the abuser are two tenants" if args.tenants else "; one tenant"
    lines = [
        "# One client abuses the cluster: the other clients' latency (bench/bench_abuse.py)",
        "",
        f"`pdserve up` at its defaults{setup}; the victim streams {args.requests} chat requests "
        f"({args.concurrency} at a time, prompts of about 300 tokens, 32 output tokens) per "
        f"condition in each of {args.rounds} alternating rounds, while the abuser runs the "
        "condition (module docstring). Ratios to `none` in the same run.",
        "",
        "| condition | victim TTFT p50 | TTFT p99 | ITL p99 | what the abuser got |",
        "|---|---|---|---|---|",
    ]
    for cond, r in res.items():
        ratios = [pct(r["ttft"], 0.5) / pct(base["ttft"], 0.5)]
        ratios += [pct(r["ttft"], 0.99) / pct(base["ttft"], 0.99)]
        ratios += [pct(r["itl"], 0.99) / pct(base["itl"], 0.99)]
        got = ", ".join(f"{k}: {v}" for k, v in sorted(r["abuser"].items(), key=str)) or "-"
        lines.append(f"| {cond} | " + " | ".join(f"{x:.2f}x" for x in ratios) + f" | {got} |")
    p50, p99 = pct(base["ttft"], 0.5) * 1e3, pct(base["ttft"], 0.99) * 1e3
    itl = pct(base["itl"], 0.99) * 1e3
    lines += [
        "",
        f"`none` (absolute): TTFT p50 {p50:.0f} ms, p99 {p99:.0f} ms, ITL p99 {itl:.0f} ms.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--conditions", default=",".join(CONDITIONS), help="which to run (none too)")
    ap.add_argument("--tenants", action="store_true", help="victim and abuser: two API keys")
    ap.add_argument("--router-args", default="", help="passed to `pdserve up --router-args`")
    ap.add_argument("--out", default=str(ROOT / "bench/results/abuse.md"))
    args = ap.parse_args()
    from pdserve.infra.procs import free_port

    args.port = args.port or free_port()
    args.prefill_pp = args.decode_pp = 1  # `pdserve up`'s defaults (bench/soak.py starts it)
    args.node_args = ""
    log_path = Path(tempfile.mkdtemp(prefix="pdserve-abuse-")) / "up.log"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    proc = start_cluster(args.port, up_args(args), log_path)
    try:
        wait_ready(proc, log_path, args.startup_timeout)
        res = asyncio.run(run(f"http://127.0.0.1:{args.port}", args))
    finally:
        stop_cluster(proc)
    text = table(res, args)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
