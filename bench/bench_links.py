"""KV transfer, TTFT and ITL over a shaped prefill->decode link, as ratios to the same hosts' link
unshaped, in one run (root: network namespaces, tests/netns_hosts.py).

Three hosts on one bridge: a prefill node, a decode node, the router; the client is this process,
one more host. Every request is disaggregated (the router's conditional rules are turned off), one
at a time, with a prompt of --prompt-tokens tokens and --max-tokens streamed tokens. Conditions
alternate round by round so that each sees the same machine: `none` (the veth link as it is),
then each rate in --rates applied with tbf on both hosts' interfaces. Delay and loss need netem,
which this machine's kernel lacks (sch_netem: "Specified qdisc kind is unknown"); the bench checks
for it and adds --rtts rows where it exists.

    sudo .venv/bin/python bench/bench_links.py [--rates 10gbit,1gbit] [--rounds 2]
        [--protocols tcp,mooncake-tcp] [--out bench/results/links.md]

With several --protocols, a cluster per KV transfer protocol runs the same conditions in turn; every
row is a ratio to the first protocol's unshaped link.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from metrics_scrape import scrape, total  # noqa: E402
from netns_hosts import Hosts, can_make_hosts  # noqa: E402

from pdserve.infra.zygote import ENV as ZYGOTE_ENV  # noqa: E402

SECRET, API_KEY = "links-bench-secret", "sk-links"


def netem_available(host) -> bool:
    r = host.run("tc", "qdisc", "add", "dev", "eth0", "root", "netem", "delay", "1ms")
    host.run("tc", "qdisc", "del", "dev", "eth0", "root")
    return r.returncode == 0


def shape(hosts, condition: str) -> None:
    """`none`, a tbf rate (`1gbit`), or with netem `rtt=2ms` / `rtt=2ms,1gbit`."""
    for h in hosts:
        h.run("tc", "qdisc", "del", "dev", "eth0", "root")
        if condition == "none":
            continue
        parts = dict(p.split("=") if "=" in p else ("rate", p) for p in condition.split(","))
        if "rtt" in parts:  # each direction carries half the round trip
            half = f"{float(parts['rtt'].rstrip('ms')) / 2}ms"
            spec = ["netem", "delay", half] + (["rate", parts["rate"]] if "rate" in parts else [])
        else:
            spec = ["tbf", "rate", parts["rate"], "burst", "1mb", "latency", "100ms"]
        r = h.run("tc", "qdisc", "add", "dev", "eth0", "root", *spec)
        if r.returncode != 0:
            raise RuntimeError(f"tc {' '.join(spec)}: {r.stderr.strip()}")


def one_request(url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, gaps between tokens) of one streamed request, seconds."""
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True},
    }
    times = []
    t0 = time.perf_counter()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{url}/generate", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            new = json.loads(line[6:]).get("token_ids", [])  # this event's tokens only
            times += [time.perf_counter()] * len(new)
    return times[0] - t0, [b - a for a, b in zip(times, times[1:], strict=False) if b > a]


def kv_seconds(prefill_url: str) -> tuple[float, float]:
    """The prefill (sending) side's per-room KV transfer seconds: sum and count."""
    fam = scrape(prefill_url)
    return (
        total(fam, "pdserve_kv_transfer_seconds_sum"),
        total(fam, "pdserve_kv_transfer_seconds_count"),
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--rates", default="10gbit,1gbit")
    ap.add_argument("--rtts", default="0.2ms,2ms,20ms", help="used only where netem exists")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=6, help="per condition and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--protocols", default="tcp,mooncake-tcp")
    ap.add_argument("--out", default=str(ROOT / "bench/results/links.md"))
    args = ap.parse_args()
    res: dict[str, dict[str, list[float]]] = {}
    for protocol in args.protocols.split(","):
        for cond, values in run_cluster(args, protocol).items():
            res[f"{protocol}, {cond}"] = values
    write_table(args, res, f"{args.protocols.split(',')[0]}, none")
    return 0


def run_cluster(args, protocol: str) -> dict[str, dict[str, list[float]]]:
    """One cluster on one KV transfer protocol, every condition in alternating rounds."""
    if why := can_make_hosts():
        sys.exit(f"bench_links: {why}")
    env = {k: v for k, v in os.environ.items() if k != ZYGOTE_ENV}
    env |= {"PDSERVE_INTERNAL_TOKEN": SECRET, "PDSERVE_API_KEY": API_KEY}
    env["PDSERVE_LOG_LEVEL"] = "WARNING"
    env["PDSERVE_TRANSFER_PROTOCOL"] = protocol
    model = ["--model", args.model] if args.model else []
    log_dir = Path("/tmp/bench_links")
    log_dir.mkdir(exist_ok=True)
    with Hosts(3, net=3) as hosts:
        p, d, r = (h.addr for h in hosts.hosts)
        cmds = [
            # no prefix caches: every request prefills and moves its whole prompt
            ["prefill", *model, "--no-prefix-cache", "--host", p, "--port", "30000"]
            + ["--bootstrap-port", "8998"],
            ["decode", *model, "--no-prefix-cache", "--host", d, "--port", "30001"],
            ["router", "--host", r, "--port", "8000", "--prefill", f"http://{p}:30000", "8998"]
            + ["--decode", f"http://{d}:30001", "--disagg-min-prompt-tokens", "0"]
            + ["--disagg-decode-prefix-fraction", "2", "--disagg-local-prefill-cost", "0"],
        ]
        for h, cmd in zip(hosts.hosts, cmds, strict=True):
            h.popen([sys.executable, "-m", "pdserve.cli", *cmd], log_dir / f"{h.addr}.log", env)
        url, prefill_url = f"http://{r}:8000", f"http://{p}:30000"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    one_request(url, [5] * 16, 2)
                    break
            except (httpx.HTTPError, AssertionError, IndexError):
                pass
            if time.monotonic() > deadline:
                sys.exit("bench_links: the cluster did not start (logs in /tmp/bench_links)")
            time.sleep(2)
        conditions = ["none", *args.rates.split(",")]
        if netem_available(hosts[0]):
            conditions += [f"rtt={x}" for x in args.rtts.split(",")]
        shaped = hosts.hosts[:2]
        res: dict[str, dict[str, list[float]]] = {
            c: {"ttft": [], "itl": [], "kv": []} for c in conditions
        }
        serial = 0  # every prompt of the run differs from every other
        for rnd in range(args.rounds):
            for cond in conditions:
                shape(shaped, cond)
                s0, c0 = kv_seconds(prefill_url)
                for _ in range(args.requests):
                    serial += 1
                    prompt = [
                        (serial * 7919 + j * 31) % 40000 + 100 for j in range(args.prompt_tokens)
                    ]
                    ttft, gaps = one_request(url, prompt, args.max_tokens)
                    res[cond]["ttft"].append(ttft)
                    res[cond]["itl"] += gaps
                s1, c1 = kv_seconds(prefill_url)
                res[cond]["kv"].append((s1 - s0) / max(1.0, c1 - c0))
                ttft_ms = statistics.median(res[cond]["ttft"]) * 1e3
                print(f"round {rnd} {cond}: TTFT p50 {ttft_ms:.0f} ms", flush=True)
        shape(shaped, "none")
    return res


def write_table(args, res: dict[str, dict[str, list[float]]], reference: str) -> None:
    base = res[reference]

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    lines = [
        "# KV transfer, TTFT and ITL over a shaped prefill->decode link",
        "",
        f"`bench/bench_links.py`: prefill, decode and router on three network namespaces, the "
        f"client a fourth; prompts of {args.prompt_tokens} tokens, {args.max_tokens} streamed "
        f"tokens, one request at a time, every one disaggregated; {args.requests} requests per "
        f"condition in each of {args.rounds} alternating rounds. Ratios to `{reference}` in the "
        "same run (a cluster per KV transfer protocol, in turn). Rates: tbf on both hosts' "
        "interfaces. This kernel has no netem, so no RTT or loss rows.",
        "",
        "| link | KV: first chunk sent to all landed | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |",
        "|---|---|---|---|---|---|",
    ]
    for cond, c in res.items():
        ratios = [statistics.median(c["kv"]) / statistics.median(base["kv"])]
        ratios += [pct(c[k], q) / pct(base[k], q) for k in ("ttft", "itl") for q in (0.5, 0.99)]
        lines.append(f"| {cond} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
    kv_ms = statistics.median(base["kv"]) * 1e3
    ttft_ms, itl_ms = pct(base["ttft"], 0.5) * 1e3, pct(base["itl"], 0.5) * 1e3
    lines += [
        "",
        f"`{reference}` (absolute, this machine): first KV chunk sent to all landed "
        f"{kv_ms:.1f} ms per request (the chunks are sent as the prefill computes them), "
        f"TTFT p50 {ttft_ms:.0f} ms, ITL p50 {itl_ms:.1f} ms.",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
