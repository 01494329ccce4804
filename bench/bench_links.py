"""KV transfer, TTFT and ITL over a shaped prefill->decode link, as ratios to the same hosts' link
unshaped, in one run (root: network namespaces, tests/netns_hosts.py).

Three hosts on one bridge: a prefill node, a decode node, the router; the client is this process,
one more host. Every request is disaggregated (the router's conditional rules are turned off), one
at a time, with a prompt of --prompt-tokens tokens and --max-tokens streamed tokens. Conditions
alternate round by round so that each sees the same machine: `none` (the veth link as it is),
then each rate in --rates applied with tbf on both hosts' interfaces, each round-trip time in
--rtts and each loss in --losses. Delay and loss use netem where the kernel has it; this machine's
kernel has no sch_netem ("Specified qdisc kind is unknown"), so there each host delays what it
receives from the other by half the round trip (iptables NFQUEUE and bench/delay_line.py; at the
receiver, because a sender's packets held in a queue count against TCP small queues and throttle
the stream, which netem avoids by orphaning them), and drops the given share of it (iptables
statistic). Each row also reports the round trip measured between the two hosts (TCP ping-pong,
p50), which includes the delay line's own overhead (about 0.1-0.4 ms here).

    sudo .venv/bin/python bench/bench_links.py [--rates 10gbit,1gbit] [--rtts 0.2ms,2ms,20ms]
        [--losses 0.1%,1%] [--rounds 2] [--protocols tcp,mooncake-tcp]
        [--out bench/results/links.md]

iptables comes from `scripts/setup.sh --test` (`make setup-test`), the Debian package.

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


class Link:
    """The prefill<->decode link's condition: `none`, a tbf rate (`1gbit`), a round trip
    (`rtt=2ms`) or a loss (`loss=1%`); netem for the last two where the kernel has it, else
    iptables on each host's input from the other, through a delay line for the round trip."""

    def __init__(self, hosts, log_dir: Path):
        self.hosts, self.log_dir = hosts, log_dir
        self.netem = netem_available(hosts[0])
        self.delay_lines: list = []

    def set(self, condition: str) -> None:
        self.clear()
        if condition == "none":
            return
        kind, _, value = condition.rpartition("=")
        for h, peer in zip(self.hosts, self.hosts[::-1], strict=True):
            if not kind:
                spec = ["tbf", "rate", value, "burst", "1mb", "latency", "100ms"]
            elif self.netem:  # each direction carries half the round trip
                half = f"{float(value.rstrip('ms')) / 2}ms"
                spec = ["netem", "delay", half] if kind == "rtt" else ["netem", "loss", value]
            else:
                self._iptables(h, peer, kind, value)
                continue
            _ok(h.run("tc", "qdisc", "add", "dev", "eth0", "root", *spec), "tc")
        time.sleep(0.5)  # the delay lines bind their queues

    def _iptables(self, h, peer, kind: str, value: str) -> None:
        rule = ["iptables", "-A", "INPUT", "-s", peer.addr]
        if kind == "loss":
            p = float(value.rstrip("%")) / 100
            _ok(h.run(*rule, "-m", "statistic", "--mode", "random", "--probability", str(p),
                      "-j", "DROP"), "iptables")  # fmt: skip
            return
        # --queue-bypass: packets pass undelayed, not dropped, while no delay line listens
        _ok(h.run(*rule, "-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"), "iptables")
        half_ms = float(value.rstrip("ms")) / 2
        line = [sys.executable, str(ROOT / "bench/delay_line.py"), "--queue", "0"]
        log = self.log_dir / f"delay-{h.addr}.log"
        self.delay_lines.append(h.popen([*line, "--delay-ms", str(half_ms)], log, dict(os.environ)))

    def clear(self) -> None:
        for p in self.delay_lines:
            p.terminate()
            p.wait(10)
        self.delay_lines = []
        for h in self.hosts:
            h.run("tc", "qdisc", "del", "dev", "eth0", "root")
            if not self.netem:
                h.run("iptables", "-F", "INPUT")


def _ok(r, what: str) -> None:
    if r.returncode != 0:
        raise RuntimeError(f"{what}: {' '.join(map(str, r.args))}: {r.stderr.strip()}")


ECHO_PORT = 5999
ECHO_SERVER = (
    "import socket\n"
    "s = socket.create_server(('{addr}', {port}))\n"
    "while True:\n"
    "    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "    while d := c.recv(64): c.sendall(d)\n"
)
PING = (
    "import socket, statistics, time\n"
    "for _ in range(100):\n"  # until the echo server listens
    "    try: s = socket.create_connection(('{addr}', {port}), timeout=10); break\n"
    "    except ConnectionRefusedError: time.sleep(0.1)\n"
    "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); r = []\n"
    "for i in range(50):\n"  # a byte of its own each: a retransmission can merge two echoes
    "    t = time.perf_counter(); s.sendall(bytes([i]))\n"
    "    while s.recv(1) != bytes([i]): pass\n"
    "    r.append(time.perf_counter() - t)\n"
    "print(statistics.median(r) * 1e3)\n"
)


def measured_rtt_ms(src, dst) -> float:
    """The round trip src -> dst -> src as the link is now: TCP ping-pong, p50 of 50."""
    r = src.run(sys.executable, "-c", PING.format(addr=dst.addr, port=ECHO_PORT), timeout=60)
    _ok(r, "ping-pong")
    return float(r.stdout)


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
    ap.add_argument("--rtts", default="0.2ms,2ms,20ms")
    ap.add_argument("--losses", default="0.1%,1%")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=6, help="per condition and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--protocols", default="tcp,mooncake-tcp")
    ap.add_argument("--out", default=str(ROOT / "bench/results/links.md"))
    args = ap.parse_args()
    res: dict[str, dict[str, list[float]]] = {}
    mechanism = ""
    for protocol in args.protocols.split(","):
        values_by_cond, mechanism = run_cluster(args, protocol)
        for cond, values in values_by_cond.items():
            res[f"{protocol}, {cond}"] = values
    write_table(args, res, f"{args.protocols.split(',')[0]}, none", mechanism)
    return 0


def run_cluster(args, protocol: str) -> tuple[dict[str, dict[str, list[float]]], str]:
    """One cluster on one KV transfer protocol, every condition in alternating rounds."""
    if why := can_make_hosts():
        sys.exit(f"bench_links: {why}")
    env = {k: v for k, v in os.environ.items() if k != ZYGOTE_ENV}
    env |= {"PDSERVE_INTERNAL_TOKEN": SECRET, "PDSERVE_API_KEY": API_KEY}
    env["PDSERVE_LOG_LEVEL"] = "WARNING"
    model = ["--model", args.model] if args.model else []
    # no prefix caches: every request prefills and moves its whole prompt
    node = [*model, "--no-prefix-cache", "--transfer-protocol", protocol]
    log_dir = Path("/tmp/bench_links")
    log_dir.mkdir(exist_ok=True)
    with Hosts(3, net=3) as hosts:
        p, d, r = (h.addr for h in hosts.hosts)
        cmds = [
            ["prefill", *node, "--host", p, "--port", "30000", "--bootstrap-port", "8998"],
            ["decode", *node, "--host", d, "--port", "30001"],
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
        conditions += [f"rtt={x}" for x in args.rtts.split(",") if x]
        conditions += [f"loss={x}" for x in args.losses.split(",") if x]
        link = Link(hosts.hosts[:2], log_dir)
        echo = ECHO_SERVER.format(addr=d, port=ECHO_PORT)
        hosts.hosts[1].popen([sys.executable, "-c", echo], log_dir / "echo.log", dict(os.environ))
        res: dict[str, dict[str, list[float]]] = {
            c: {"ttft": [], "itl": [], "kv": [], "rtt": []} for c in conditions
        }
        serial = 0  # every prompt of the run differs from every other
        try:
            for rnd in range(args.rounds):
                for cond in conditions:
                    link.set(cond)
                    res[cond]["rtt"].append(measured_rtt_ms(hosts.hosts[0], hosts.hosts[1]))
                    s0, c0 = kv_seconds(prefill_url)
                    for _ in range(args.requests):
                        serial += 1
                        prompt = [
                            (serial * 7919 + j * 31) % 40000 + 100
                            for j in range(args.prompt_tokens)
                        ]
                        ttft, gaps = one_request(url, prompt, args.max_tokens)
                        res[cond]["ttft"].append(ttft)
                        res[cond]["itl"] += gaps
                    s1, c1 = kv_seconds(prefill_url)
                    res[cond]["kv"].append((s1 - s0) / max(1.0, c1 - c0))
                    ttft_ms = statistics.median(res[cond]["ttft"]) * 1e3
                    rtt = res[cond]["rtt"][-1]
                    print(f"round {rnd} {cond}: RTT {rtt:.2f} ms, TTFT p50 {ttft_ms:.0f} ms")
        finally:
            link.clear()
    mechanism = (
        "netem on both hosts' interfaces"
        if link.netem
        else "this kernel has no netem: iptables on each host's input from the other, half the "
        "round trip through bench/delay_line.py (NFQUEUE), the loss by iptables statistic"
    )
    return res, mechanism


def write_table(
    args, res: dict[str, dict[str, list[float]]], reference: str, mechanism: str
) -> None:
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
        f"interfaces. Round trips and losses: {mechanism}. RTT: the round trip measured "
        "between the prefill and decode hosts under the condition (TCP ping-pong, p50, ms).",
        "",
        "| link | RTT | KV: first chunk sent to all landed | TTFT p50 | TTFT p99 | ITL p50 | "
        "ITL p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for cond, c in res.items():
        ratios = [statistics.median(c["kv"]) / statistics.median(base["kv"])]
        ratios += [pct(c[k], q) / pct(base[k], q) for k in ("ttft", "itl") for q in (0.5, 0.99)]
        rtt = f"{statistics.median(c['rtt']):.2f}"
        lines.append(f"| {cond} | {rtt} | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
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
