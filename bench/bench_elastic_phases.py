"""Elastic prefill:decode under a phase-shift workload (issue #46): goodput at a TTFT and ITL SLO
of an elastic cluster against the static splits, all in one run.

Every cluster has 3 nodes (`pdserve up`, PP 1 each, the default model and dtype). The workload is
closed-loop, `--concurrency` streamed chat requests at a time, in phases that follow each other
without a pause, each `--phase-seconds` long:

  prefill   long prompts (`--long-words` random words), `--short-tokens` output tokens
  decode    short prompts (`--short-words`), `--long-tokens` output tokens
  prefill   again

Clusters (each started, measured and stopped in turn):

  2P+1D R      2 prefill + 1 decode nodes, routed by R (below)
  1P+2D R      1 prefill + 2 decode nodes
  elastic R    `pdserve up --elastic`: 2 prefill + 1 decode elastic nodes to start with, the
               router's controller on (targets `--elastic-ttft-ms`, `--elastic-itl-ms`)
  elastic R from 1P+2D
               the same, from 1 prefill + 2 decode nodes

where the routing R is one of
  pd           every request disaggregated
  cond         conditional disaggregation, the router's default
  short        only prompts under `--disagg-min-prompt-tokens` (64) prefilled on the decode
               node, every longer one disaggregated (`--disagg-local-prefill-cost 0`)
  w1           the decode node alone only where it gains more TTFT than it delays the streams
               open there (`--disagg-stream-delay-weight 1`, `--disagg-min-prompt-tokens 0`)

With `--peer-url` (vLLM-CPU started outside, ../shared/peers/start_vllm.sh) the same phases run
against that server first, and a table gives every cluster's goodput over its.

Goodput of a phase: requests that started in it, were answered 200, and met TTFT <= `--slo-ttft-ms`
and mean ITL <= `--slo-itl-ms`, per second of the phase. Also each phase's completed requests,
TTFT and ITL p50/p99, failures, and (elastic) the controller's moves with their times.

Every cluster it starts is stopped, also on Ctrl-C or SIGTERM. Writes `--out` and prints it.

    .venv/bin/python bench/bench_elastic_phases.py [--phase-seconds 90] [--concurrency 8]
        [--slo-ttft-ms 4000] [--slo-itl-ms 250] [--clusters elastic,2P+1D pd,...]
        [--out bench/results/elastic_phases.md]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import signal
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pd_routes import ALWAYS  # noqa: E402  (every request disaggregated)
from bench_slo import chat, cluster, new_rec, pct, stream_one  # noqa: E402

from pdserve.infra.cluster_secret import ENV as SECRET_ENV  # noqa: E402
from pdserve.infra.cluster_secret import cluster_secret  # noqa: E402
from pdserve.infra.request_signing import SignedAuth  # noqa: E402

# how the router routes, by the name's last word (the router's flags)
ROUTINGS = {
    "pd": ALWAYS,  # every request disaggregated
    "cond": [],  # the router's default: conditional disaggregation
    "short": ["--disagg-local-prefill-cost", "0"],  # only prompts under 64 tokens stay local
    # the pair unless the decode node alone gains more TTFT than it delays its streams
    "w1": ["--disagg-min-prompt-tokens", "0", "--disagg-stream-delay-weight", "1"],
}
SPLITS = {
    "2P+1D": "--prefill-nodes 2 --decode-nodes 1",
    "1P+2D": "--prefill-nodes 1 --decode-nodes 2",
}
CLUSTERS = {
    **{f"{split} {r}": (nodes, False, r) for split, nodes in SPLITS.items() for r in ROUTINGS},
    **{f"elastic {r}": (SPLITS["2P+1D"], True, r) for r in ROUTINGS},
    **{f"elastic {r} from 1P+2D": (SPLITS["1P+2D"], True, r) for r in ROUTINGS},
}
ELASTIC = tuple(name for name, (_, elastic, _) in CLUSTERS.items() if elastic)
PEER = "peer (--peer-url)"
PHASES = ("prefill", "decode", "prefill")


async def run_phases(url: str, args) -> tuple[list[dict], list[dict], list[dict]]:
    """The phases on the cluster at `url`: one record per request (with its phase and start), the
    controller's moves (from GET /workers) with their times since the first phase began, and its
    view of the load every 2 s (elastic clusters)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(600, connect=30)
    secret = cluster_secret()
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        warm = [new_rec() for _ in range(4)]
        await asyncio.gather(
            *(stream_one(client, chat(model, 900_000 + i, 50, 8, 0), r) for i, r in enumerate(warm))
        )
        recs: list[dict] = []
        serial = iter(range(10**9))
        t0, wall0 = time.perf_counter(), time.time()

        async def worker() -> None:
            while True:
                now = time.perf_counter() - t0
                k = int(now // args.phase_seconds)
                if k >= len(PHASES):
                    return
                phase = PHASES[k]
                words, tokens = (
                    (args.long_words, args.short_tokens)
                    if phase == "prefill"
                    else (args.short_words, args.long_tokens)
                )
                rec = {**new_rec(), "phase": k, "start": now}
                recs.append(rec)
                await stream_one(client, chat(model, next(serial), words, tokens, args.seed), rec)

        views: list[dict] = []

        async def watch() -> None:  # the controller's view, every 2 s (elastic clusters)
            while secret:
                with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
                    got = await client.get("/workers", auth=SignedAuth(secret))
                    last = (got.json().get("elastic") or {}).get("last")
                    if last:
                        views.append({**last, "at": time.perf_counter() - t0})
                await asyncio.sleep(2.0)

        watcher = asyncio.create_task(watch())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        moves = []
        if secret:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                got = await client.get("/workers", auth=SignedAuth(secret))
                moves = (got.json().get("elastic") or {}).get("moves") or []
        for m in moves:  # seconds since the first phase began
            m["at"] = round(m["at"] - wall0, 1)
        return recs, moves, views


def phase_stats(recs: list[dict], k: int, args) -> dict:
    mine = [r for r in recs if r["phase"] == k]
    done = [r for r in mine if r["status"] == 200 and r["done"] and r["ttft"] is not None]
    itls = [sum(r["gaps"]) / len(r["gaps"]) for r in done if r["gaps"]]

    def good(r: dict) -> bool:
        itl = sum(r["gaps"]) / len(r["gaps"]) if r["gaps"] else 0.0
        return r["ttft"] * 1e3 <= args.slo_ttft_ms and itl * 1e3 <= args.slo_itl_ms

    return {
        "sent": len(mine),
        "completed": len(done),
        "failed": len(mine) - len(done),
        "goodput": sum(good(r) for r in done) / args.phase_seconds,
        "ttft_p50": pct([r["ttft"] for r in done], 0.5),
        "ttft_p99": pct([r["ttft"] for r in done], 0.99),
        "itl_p50": pct(itls, 0.5),
        "itl_p99": pct(itls, 0.99),
    }


def view_stats(views: list[dict], k: int, args) -> dict:
    """The controller's view during phase k: its predicted prefill wait and decode step (p50),
    and why it held, counted by the reason's first words."""
    mine = [v for v in views if int(v["at"] // args.phase_seconds) == k]
    held: dict[str, int] = {}
    for v in mine:
        why = (v.get("held") or "moving").split(" (")[0]
        held[why] = held.get(why, 0) + 1
    return {
        "ttft_p50": pct([v["ttft_s"] for v in mine], 0.5) if mine else 0.0,
        "itl_p50": pct([v["itl_s"] for v in mine], 0.5) if mine else 0.0,
        "held": held,
    }


def report(results: dict, args, meta: dict) -> str:
    lines = [
        "# Elastic prefill:decode under a phase-shift workload",
        "",
        f"`bench/bench_elastic_phases.py`, {meta['when']}, {meta['host']}, {os.cpu_count()} cores; "
        f"model {meta.get('model', 'default')}, 3 nodes at PP 1 each. Phases of "
        f"{args.phase_seconds:g} s: prefill ({args.long_words} words, {args.short_tokens} tokens "
        f"out), decode ({args.short_words} words, {args.long_tokens} tokens out), prefill; "
        f"{args.concurrency} streams at a time. Goodput: requests per second that met TTFT <= "
        f"{args.slo_ttft_ms:g} ms and mean ITL <= {args.slo_itl_ms:g} ms.",
        "",
        "| cluster | phase | goodput (req/s) | completed | failed | TTFT p50 / p99 (s) "
        "| ITL p50 / p99 (ms) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, res in results.items():
        for k, st in enumerate(res["phases"]):
            lines.append(
                f"| {name} | {k + 1} {PHASES[k]} | {st['goodput']:.3f} | {st['completed']} | "
                f"{st['failed']} | {st['ttft_p50']:.2f} / {st['ttft_p99']:.2f} | "
                f"{st['itl_p50'] * 1e3:.0f} / {st['itl_p99'] * 1e3:.0f} |"
            )
    lines += ["", "Goodput over the whole run, and each phase's ratio to the best static cluster:"]
    lines += ["", "| cluster | whole run (req/s) | " + " | ".join(
        f"phase {k + 1} / best static" for k in range(len(PHASES))) + " |"]  # fmt: skip
    lines.append("|---|---:|" + "---:|" * len(PHASES))
    static = [n for n in results if n not in ELASTIC and n != PEER]
    for name, res in results.items():
        whole = sum(st["goodput"] for st in res["phases"]) / len(PHASES)
        cells = []
        for k, st in enumerate(res["phases"]):
            best = max((results[n]["phases"][k]["goodput"] for n in static), default=0.0)
            cells.append(f"{st['goodput'] / best:.2f}x" if best > 0 else "n/a")
        lines.append(f"| {name} | {whole:.3f} | " + " | ".join(cells) + " |")
    if PEER in results:
        lines += _over_peer(results)
    for name in ELASTIC:
        moves = results.get(name, {}).get("moves") or []
        if moves:
            lines += ["", f"The controller's moves ({name}; `at`: seconds into the run):", ""]
            lines += [f"- {json.dumps(m)}" for m in moves]
        views = results.get(name, {}).get("views") or []
        if views:
            lines += [
                "",
                f"The controller's view ({name}, sampled every 2 s): per phase its predicted "
                "prefill wait and decode step (p50), and why it held (samples):",
                "",
            ]
            lines += [
                f"- phase {k + 1}: ttft {v['ttft_p50']:.3f} s, itl {v['itl_p50'] * 1e3:.1f} ms; "
                + json.dumps(v["held"])
                for k, v in enumerate(views)
            ]
    return "\n".join(lines) + "\n"


def stop_peer(pid_file: Path, timeout_s: float = 60.0) -> None:
    """SIGTERM to the peer's server process, then up to `timeout_s` for it to exit (SIGKILL
    after)."""
    pid = int(pid_file.read_text().strip())
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"[elastic] peer {pid} stopped", flush=True)
            return
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    print(f"[elastic] peer {pid} killed after {timeout_s:g} s", flush=True)


def _over_peer(results: dict) -> list[str]:
    """Each cluster's goodput over the peer's, per phase and over the whole run."""
    peer = results[PEER]["phases"]
    lines = ["", "Goodput over the peer's (the same phases against it, first in the run):", ""]
    lines.append("| cluster | whole run | " + " | ".join(
        f"phase {k + 1}" for k in range(len(PHASES))) + " |")  # fmt: skip
    lines.append("|---|---:|" + "---:|" * len(PHASES))
    peer_whole = sum(st["goodput"] for st in peer)
    for name, res in results.items():
        if name == PEER:
            continue
        whole = sum(st["goodput"] for st in res["phases"])
        cells = [
            f"{st['goodput'] / p['goodput']:.2f}x" if p["goodput"] > 0 else "n/a"
            for st, p in zip(res["phases"], peer, strict=True)
        ]
        ratio = f"{whole / peer_whole:.2f}x" if peer_whole > 0 else "n/a"
        lines.append(f"| {name} | {ratio} | " + " | ".join(cells) + " |")
    return lines


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--clusters",
        default="2P+1D pd,1P+2D pd,2P+1D cond,1P+2D cond,elastic pd,elastic pd from 1P+2D",
        help=f"names, comma-separated, of: {', '.join(CLUSTERS)}",
    )
    ap.add_argument("--phase-seconds", type=float, default=90.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--long-words", type=int, default=600)
    ap.add_argument("--short-words", type=int, default=20)
    ap.add_argument("--long-tokens", type=int, default=128)
    ap.add_argument("--short-tokens", type=int, default=4)
    ap.add_argument("--slo-ttft-ms", type=float, default=4000.0)
    ap.add_argument("--slo-itl-ms", type=float, default=250.0)
    ap.add_argument(
        "--elastic-ttft-ms",
        type=float,
        default=2000.0,
        help="the controller's prefill-wait target (--elastic-ttft-target-ms)",
    )
    ap.add_argument(
        "--elastic-itl-ms",
        type=float,
        default=100.0,
        help="the controller's decode-step target (--elastic-itl-target-ms)",
    )
    ap.add_argument(
        "--peer-url",
        default=None,
        help="a server started outside (vLLM-CPU: ../shared/peers/start_vllm.sh): the same phases "
        "against it first, and every cluster's goodput over its",
    )
    ap.add_argument(
        "--peer-pid-file",
        default=None,
        help="the peer's PID file (start_vllm.sh writes $PEER_DIR/vllm.pid): stopped (SIGTERM, "
        "then waited for) after its phases, so that it does not run beside the clusters",
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="bench/results/elastic_phases.md")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    # one secret for every cluster of the run (pdserve up takes it from the environment), so this
    # script can read the router's GET /workers, signed
    os.environ.setdefault(SECRET_ENV, secrets.token_urlsafe(32))
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node()}
    results: dict[str, dict] = {}
    if args.peer_url:
        recs, _, _ = asyncio.run(run_phases(args.peer_url, args))
        results[PEER] = {"phases": [phase_stats(recs, k, args) for k in range(len(PHASES))]}
        print(f"[elastic] {PEER}: {results[PEER]['phases']}", flush=True)
        if args.peer_pid_file:
            stop_peer(Path(args.peer_pid_file))
    for name in [n for n in args.clusters.split(",") if n]:
        nodes, elastic, routing = CLUSTERS[name]
        router = list(ROUTINGS[routing])
        if elastic:  # the controller's targets
            router += ["--elastic-ttft-target-ms", str(args.elastic_ttft_ms)]
            router += ["--elastic-itl-target-ms", str(args.elastic_itl_ms)]
        up_args = nodes + (" --elastic" if elastic else "")
        up_args += f" --router-args '{' '.join(router)}'" if router else ""
        with cluster(args, "", up_args) as url:
            recs, moves, views = asyncio.run(run_phases(url, args))
        results[name] = {
            "phases": [phase_stats(recs, k, args) for k in range(len(PHASES))],
            "moves": moves,
            "views": [view_stats(views, k, args) for k in range(len(PHASES))] if views else [],
        }
        print(f"[elastic] {name}: {results[name]['phases']}", flush=True)
    text = report(results, args, meta)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
