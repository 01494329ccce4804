"""Randomised fault campaign: abort storm + transfer stall + rank SIGKILL on real PD node pairs.

    python bench/chaos_campaign.py [--seeds N] [--layouts 2,2 3,2 2,3] [--requests 24]

For each layout (prefill PP, decode PP) and seed: a prefill node and a decode node as real process
groups (tests/pd_cluster.py: the tests' fast KV timeouts, PDSERVE_RANK_CONSENSUS_CHECK=1), the
router's part played by this script (the same request to both nodes), then three phases:

  1. abort storm + stall: `--requests` requests at once, each with a seeded fate (run to the end,
     or aborted at the prefill node, the decode node or both after a random delay), while the
     prefill node's last rank is SIGSTOPped for longer than the transfer timeout and continued;
  2. settle: every request must have ended (else a hang), then every rank of both nodes must hold
     no page, counting prefix-cache pages still locked by a request (else pages left);
  3. SIGKILL: a second, smaller storm while a random non-zero rank of one node is SIGKILLed; every
     request must end (answer or error, within the bound) and the surviving node hold no page.

Divergences are the rank consensus checker's failures in the node logs. Prints one line per run
and a summary; exit status 1 if any divergence, hang or page left. CPU-heavy: opt-in
(`make chaos-campaign`), not part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from pd_cluster import body, decode_node, prefill_node  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

STALL_S = 9.5  # SIGSTOP length: beyond the fast transfer timeout (8 s)
REQUEST_BOUND_S = 90.0  # a request not answered within this is a hang
SETTLE_S = 45.0  # quarantine (10 s) + votes + stats pushes
MAX_NEW = 16
SPREAD_S = 14.0  # requests start over this window, so some are in flight at each fault
DIVERGED = ("rank consensus check FAILED", "diverged")


def rank_pids(front: subprocess.Popen) -> dict[int, int]:
    """pp_rank -> pid of a node's rank processes (children of its front with a --spec)."""
    out = subprocess.run(
        ["ps", "--ppid", str(front.pid), "-o", "pid="], capture_output=True, text=True, timeout=10
    )
    ranks = {}
    for pid in map(int, out.stdout.split()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--spec" in argv:
            ranks[json.loads(argv[argv.index(b"--spec") + 1])["pp_rank"]] = pid
    return ranks


def pages_left(url: str) -> int | None:
    """Pages held on all ranks of a node, plus prefix-cache pages a request still locks; None if the
    node does not answer or a rank reports nothing (a dead node)."""
    try:
        ranks = httpx.get(f"{url}/server_info", timeout=10).json()["ranks"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    if any(r is None for r in ranks):
        return None
    return sum(r["held_pages"] + r.get("locked_cached_pages", 0) for r in ranks)


def wait_pages(url: str, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        n = pages_left(url)
        if n == 0 or time.monotonic() > deadline:
            return n
        time.sleep(1.0)


async def storm(
    purl: str,
    durl: str,
    bport: int,
    rng: random.Random,
    n: int,
    prompts: list[list[int]],
    fault=None,
) -> tuple[int, int, int]:
    """n requests at once with seeded fates; `fault` (a coroutine) runs alongside. Returns
    (answered, errors, hangs)."""
    async with httpx.AsyncClient(timeout=REQUEST_BOUND_S) as c:

        async def one(i: int):
            rid, room = f"c{rng.getrandbits(40):x}", rng.getrandbits(63)
            b = {**body(prompts[i % len(prompts)], room, bport, MAX_NEW), "rid": rid}
            fate, delay = (
                rng.choice(["none", "none", "prefill", "decode", "both"]),
                rng.uniform(0.0, 2.0),
            )
            await asyncio.sleep(rng.uniform(0.0, SPREAD_S))
            tp = asyncio.create_task(c.post(f"{purl}/generate", json=b))
            td = asyncio.create_task(c.post(f"{durl}/generate", json=b))
            if fate != "none":
                await asyncio.sleep(delay)
                for url in (
                    (purl,) if fate == "prefill" else (durl,) if fate == "decode" else (purl, durl)
                ):
                    with contextlib.suppress(httpx.HTTPError):
                        await c.post(f"{url}/abort", json={"rid": rid})
            res = await asyncio.gather(tp, td, return_exceptions=True)
            if any(isinstance(r, httpx.TimeoutException) for r in res):
                return "hang"
            d = res[1]
            return "ok" if isinstance(d, httpx.Response) and d.status_code == 200 else "error"

        tasks = [one(i) for i in range(n)]
        if fault is not None:
            tasks.append(fault)
        got = await asyncio.gather(*tasks)
    got = [g for g in got if g in ("ok", "error", "hang")]
    return got.count("ok"), got.count("error"), got.count("hang")


def divergences(*logs: Path) -> int:
    n = 0
    for log in logs:
        text = log.read_text(errors="replace") if log.exists() else ""
        n += sum(text.count(s) for s in DIVERGED[:1])
    return n


def one_run(model: Path, ppp: int, dpp: int, seed: int, n: int, tmp: Path) -> dict:
    rng = random.Random(seed)
    # token ids inside the tiny test model's vocabulary (384)
    prompts = [
        [rng.randrange(1, 300) for _ in range(rng.choice([5, 12, 40, 70]))] for _ in range(8)
    ]
    out = {"layout": (ppp, dpp), "seed": seed, "divergences": 0, "hangs": 0, "pages_left": 0}
    t0 = time.monotonic()
    with (
        prefill_node(model, ppp, tmp) as (purl, bport, pproc),
        decode_node(model, dpp, tmp) as (durl, dproc),
    ):

        async def stall():
            await asyncio.sleep(rng.uniform(1.0, 4.0))
            pid = rank_pids(pproc).get(ppp - 1)
            out["stalled"] = bool(pid)
            if pid:
                os.kill(pid, signal.SIGSTOP)
                await asyncio.sleep(STALL_S)
                os.kill(pid, signal.SIGCONT)

        ok, err, hang = asyncio.run(storm(purl, durl, bport, rng, n, prompts, stall()))
        out.update(storm_ok=ok, storm_err=err)
        out["hangs"] += hang
        left = [wait_pages(purl, SETTLE_S), wait_pages(durl, SETTLE_S)]
        out["pages_left"] += sum(x for x in left if x)
        out["unreadable"] = sum(x is None for x in left)

        victim_is_prefill = rng.random() < 0.5
        victim_proc, survivor = (pproc, durl) if victim_is_prefill else (dproc, purl)
        victim_pp = ppp if victim_is_prefill else dpp

        async def kill():
            await asyncio.sleep(rng.uniform(1.0, 6.0))
            pid = rank_pids(victim_proc).get(rng.randrange(1, victim_pp))
            out["killed"] = bool(pid)
            if pid:
                os.kill(pid, signal.SIGKILL)

        ok2, err2, hang2 = asyncio.run(
            storm(purl, durl, bport, rng, max(4, n // 3), prompts, kill())
        )
        out.update(
            kill_node="prefill" if victim_is_prefill else "decode", kill_ok=ok2, kill_err=err2
        )
        out["hangs"] += hang2
        left2 = wait_pages(survivor, SETTLE_S)
        out["pages_left"] += left2 or 0
        out["unreadable"] += left2 is None
    out["divergences"] = divergences(tmp / "prefill.log", tmp / "decode.log")
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, default=1, help="seeds per layout")
    ap.add_argument("--first-seed", type=int, default=1)
    ap.add_argument(
        "--layouts", nargs="+", default=["2,2", "3,2", "2,3"], help="prefill PP,decode PP"
    )
    ap.add_argument("--requests", type=int, default=24, help="requests in the abort storm")
    a = ap.parse_args(argv)
    layouts = [tuple(int(x) for x in s.split(",")) for s in a.layouts]
    base = Path(tempfile.mkdtemp(prefix="pdserve-campaign-"))
    model = build_tiny_model(base / "tiny6", num_layers=6, seed=1)
    runs, t_all = [], time.monotonic()
    for ppp, dpp in layouts:
        for seed in range(a.first_seed, a.first_seed + a.seeds):
            tmp = base / f"p{ppp}d{dpp}s{seed}"
            tmp.mkdir()
            r = one_run(model, ppp, dpp, seed, a.requests, tmp)
            runs.append(r)
            print(json.dumps(r), flush=True)
    tot = {k: sum(r[k] for r in runs) for k in ("divergences", "hangs", "pages_left", "unreadable")}
    print(
        f"campaign: {len(runs)} runs ({a.seeds} seed(s) x {len(layouts)} layouts), "
        f"{time.monotonic() - t_all:.0f} s: divergences {tot['divergences']}, "
        f"hangs {tot['hangs']}, pages left {tot['pages_left']}, nodes unreadable at the check "
        f"{tot['unreadable']}; logs in {base}"
    )
    return 1 if tot["divergences"] or tot["hangs"] or tot["pages_left"] else 0


if __name__ == "__main__":
    sys.exit(main())
