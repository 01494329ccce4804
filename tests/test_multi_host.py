"""A cluster across five hosts (network namespaces on one bridge, tests/netns_hosts.py), started
with the chart's commands (`pdserve launch` from the chart's values, docs/DEPLOY.md): a prefill
node with PP 2 over two hosts (`--nnodes 2 --node-rank ...`), a decode node with PP 2 over two
hosts, and a router on the fifth.
The test's own namespace is one more host on the bridge: the client, and the hostile peer.

* fp32 greedy answers through the router, every prompt disaggregated, equal transformers';
* every process listens only on its host's address (or its own loopback);
* every frame on the bridge, from before the first process starts, is searched for the secret;
* a /generate the router signed, taken off the bridge, is refused replayed and changed;
* a hostile host connects to every listening port of every process and sends noise, forged
  handshakes and data-plane frames; every process lives on, and the answers stay exact.
"""

from __future__ import annotations

import ipaddress
import os
import secrets

import pytest
from cluster import ClusterAuth, node_args
from host_cluster import generate, host_env, launch_commands, start, wait_workers
from metrics_scrape import scrape, total
from netns_hosts import Hosts, can_make_hosts
from packet_capture import Capture, can_capture, encodings, first_request, send_raw
from reference import hf_greedy, load_hf

from pdserve.infra.request_signing import SCHEME
from pdserve.kv_transfer import tcp_transport as tt

WHY_NOT = can_make_hosts() or ("" if can_capture() else "capturing frames needs root")
pytestmark = [
    pytest.mark.hosts,
    pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "hosts can be made"),
]

MAX_NEW = 8
PROMPTS = [[5, 17, 3, 99, 42, 7], list(range(10, 50)), [200, 3, 3, 3, 150, 61, 8, 9, 1, 77, 31]]
API_KEY = "sk-multi-host"
PREFILL_PORT, BOOTSTRAP_PORT, DECODE_PORT, ROUTER_PORT = 30000, 8998, 30001, 8000


def node_commands(model: str, hosts: list[str], tmp) -> list[list[str]]:
    """The deployment of docs/DEPLOY.md ("A node over several hosts"), its command lines made by
    `pdserve launch` from the chart's values, as the chart's own are: prefill PP 2 over hosts 0-1,
    decode PP 2 over hosts 2-3, the router on host 4."""
    p0, p1, d0, d1, r = hosts
    node = {"ranksPerPod": 1, "extraArgs": node_args()}  # PP 2 over two hosts
    # every prompt through the pair, none prefilled on the decode node
    disagg = ["--disagg-min-prompt-tokens", "0", "--disagg-decode-prefix-fraction", "2"]
    values = {
        "model": {"path": model},
        "leaders": {"prefill": [p0], "decode": [d0]},
        "prefill": {**node, "port": PREFILL_PORT, "bootstrapPort": BOOTSTRAP_PORT},
        "decode": {**node, "port": DECODE_PORT, "distPort": 29600},
        "router": {"port": ROUTER_PORT, "extraArgs": [
            "--health-interval", "1", *disagg, "--disagg-local-prefill-cost", "0"]},
    }  # fmt: skip
    plan = [("prefill", 0, 0, p0), ("prefill", 0, 1, p1), ("decode", 0, 0, d0)]
    plan += [("decode", 0, 1, d1), ("router", 0, 0, r)]
    return launch_commands(values, tmp, plan)


@pytest.fixture(scope="module")
def hf_ref(tiny6):
    return hf_greedy(load_hf(tiny6), PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def cluster(tiny6, tmp_path_factory):
    """The five hosts, their processes, and the bridge's frames from before the first start."""
    secret = secrets.token_urlsafe(32)
    tmp = tmp_path_factory.mktemp("hosts")
    env = host_env(secret, API_KEY, kv_timeout_s=30)
    with Hosts(5) as hosts:
        addrs = [h.addr for h in hosts.hosts]
        logs = [tmp / f"host{i}.log" for i in range(5)]
        with Capture(hosts.bridge, encodings(secret), {DECODE_PORT}) as cap:
            start(hosts, node_commands(str(tiny6), addrs, tmp), logs, env)
            url = f"http://{addrs[4]}:{ROUTER_PORT}"
            auth = ClusterAuth(secret)
            wait_workers(url, auth, hosts, logs, count=2, timeout=400)
            yield {"url": url, "auth": auth, "hosts": hosts, "capture": cap, "logs": logs}
        assert not [h.name for h in hosts.hosts if any(p.poll() is not None for p in h.procs)]
    assert hosts.leftovers() == [], "the hosts were not torn down"


def test_answers_across_five_hosts_equal_transformers(cluster, hf_ref):
    url = cluster["url"]
    assert [generate(url, ids, MAX_NEW, API_KEY) for ids in PROMPTS] == hf_ref
    disaggregated = total(
        scrape(url), "pdserve_router_route_decisions_total", path="disaggregated", reason="default"
    )
    assert disaggregated >= len(PROMPTS)  # each went through the prefill node and a KV transfer


def _proc_net_listeners(pid: int) -> list[tuple[str, int]]:
    """(ip, port) of every listening TCP socket in the network namespace of process `pid`, from
    its /proc/PID/net/tcp{,6} (psutil reads the caller's own namespace)."""
    out = []
    for name, size in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{name}") as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            if state != "0A":  # TCP_LISTEN
                continue
            hexip, hexport = local.split(":")
            raw = bytes.fromhex(hexip)
            # the kernel prints each 32-bit word in host (little-endian) order
            ip = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
            out.append((str(ipaddress.ip_address(ip)), int(hexport, 16)))
    return out


def _listening(hosts: Hosts) -> dict[str, list[tuple[str, int]]]:
    """host -> (ip, port) of every listening socket in it (every one belongs to the cluster)."""
    return {h.addr: sorted(set(_proc_net_listeners(h.procs[0].pid))) for h in hosts.hosts}


def test_every_process_listens_on_its_host_only(cluster):
    listening = _listening(cluster["hosts"])
    assert len(listening) == 5 and all(listening.values()), listening
    wide = [
        f"{host}: {ip}:{port}"
        for host, socks in listening.items()
        for ip, port in socks
        if ip != host and not ipaddress.ip_address(ip).is_loopback
    ]
    assert not wide, "listening beyond the host's address:\n" + "\n".join(wide)


def test_a_signed_request_off_the_bridge_is_refused_replayed_and_changed(cluster):
    cap = cluster["capture"]
    decode = cluster["hosts"][2].addr
    captured = next(
        (r for s in cap.streams_to(DECODE_PORT) if (r := first_request(s, b"POST /generate"))),
        None,
    )
    assert captured is not None and SCHEME.encode() in captured
    replayed = send_raw(decode, DECODE_PORT, captured)
    assert replayed.startswith(b"HTTP/1.1 401"), replayed[:300]
    head, body = captured.split(b"\r\n\r\n", 1)
    i = body.index(b"[") + 1
    changed = body[:i] + (b"9" if body[i : i + 1] != b"9" else b"8") + body[i + 1 :]
    answer = send_raw(decode, DECODE_PORT, head + b"\r\n\r\n" + changed)
    assert answer.startswith(b"HTTP/1.1 401") and b"bad signature" in answer, answer[:300]


def test_a_hostile_host_changes_nothing(cluster, hf_ref):
    """From the test's namespace, another host on the bridge: every listening port of every
    process of every host gets noise, a forged data-plane handshake and raw data-plane write
    frames aimed at low and high addresses. Every process lives on; answers stay exact."""
    hosts, url = cluster["hosts"], cluster["url"]
    frame_head = tt._FRAME.pack(tt.WRITE, 1, 1, 4096)
    attacks = [
        os.urandom(2048),
        b"PKV1" + os.urandom(64),
        *(
            frame_head + tt._ENTRY.pack(addr, 4096) + b"\xff" * 4096 + os.urandom(32)
            for addr in (0x10000, 0x7F0000000000)
        ),
    ]
    ports = 0
    for host, socks in _listening(hosts).items():
        for ip, port in socks:
            if ip != host:
                continue  # loopback of that host: no other host reaches it
            for attack in attacks:
                try:
                    send_raw(ip, port, attack, read=False)
                except OSError:
                    pass
            ports += 1
    assert ports >= 10
    assert [generate(url, ids, MAX_NEW, API_KEY) for ids in PROMPTS] == hf_ref
    dead = [(h.name, p.args) for h in hosts.hosts for p in h.procs if p.poll() is not None]
    assert not dead, dead


def test_no_frame_on_the_bridge_holds_the_secret(cluster):
    """Last in the file: the capture has seen start-up, every request, the attacks and replays."""
    cap = cluster["capture"]
    assert cap.frames > 100 and cap.tcp_bytes > 0
    assert cap.found == [], f"the secret crossed the bridge: {cap.found[:5]}"
