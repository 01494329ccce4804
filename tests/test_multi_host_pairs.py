"""Health per (prefill, decode) pair on real hosts (router/routing/pair_health.py): two prefill and
two decode nodes on four hosts and a router on the fifth (tests/netns_hosts.py). The link between
one prefill host and one decode host is cut both ways (every packet between the two dropped,
silently), while each stays reachable from every other host. Requests keep being answered exactly
(none lost: the router retries them on a good pair), the router stops pairing those two nodes
while both stay healthy, tries the pair again once per open period, and pairs them again once
the link heals."""

from __future__ import annotations

import time

import httpx
import pytest
from cluster import ClusterAuth, node_args
from host_cluster import generate, host_env, launch_commands, start, wait_workers
from netns_hosts import Hosts, can_make_hosts
from reference import hf_greedy, load_hf

WHY_NOT = can_make_hosts()
pytestmark = [
    pytest.mark.hosts,
    pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "hosts can be made"),
]

MAX_NEW = 6
PROMPTS = [[i, 7 + i, 3, 99 - i, 42, 5 + 2 * i] for i in range(1, 9)]
API_KEY = "sk-pairs"
OPEN_S = 5.0  # --pair-open-seconds


def commands(model: str, addrs: list[str], tmp) -> list[list[str]]:
    """Two prefill and two decode nodes of PP 1 and the router, through `pdserve launch` from the
    chart's values (as the chart starts them)."""
    p1, p2, d1, d2, r = addrs
    node = {"replicas": 2, "pp": 1, "ranksPerPod": 1, "extraArgs": node_args()}
    router = ["--health-interval", "1", "--disagg-min-prompt-tokens", "0"]
    router += ["--disagg-decode-prefix-fraction", "2", "--disagg-local-prefill-cost", "0"]
    router += ["--pair-open-seconds", str(OPEN_S)]
    # one failure unpairs (the default is 2); random choices try every pair, the cut one too
    router += ["--pair-failure-threshold", "1"]
    router += ["--prefill-policy", "random", "--decode-policy", "random"]
    values = {
        "model": {"path": model},
        "leaders": {"prefill": [p1, p2], "decode": [d1, d2]},
        "prefill": node,
        "decode": node,
        "router": {"extraArgs": router},
    }
    plan = [("prefill", 0, 0, p1), ("prefill", 1, 0, p2), ("decode", 0, 0, d1)]
    plan += [("decode", 1, 0, d2), ("router", 0, 0, r)]
    return launch_commands(values, tmp, plan)


@pytest.fixture(scope="module")
def cluster(tiny6, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pairs")
    env = host_env("pairs-secret", API_KEY, kv_timeout_s=3)
    with Hosts(5, net=1) as hosts:
        addrs = [h.addr for h in hosts.hosts]
        logs = [tmp / f"host{i}.log" for i in range(5)]
        start(hosts, commands(str(tiny6), addrs, tmp), logs, env)
        url, auth = f"http://{addrs[4]}:8000", ClusterAuth("pairs-secret")
        wait_workers(url, auth, hosts, logs, count=4, timeout=300)
        yield {"url": url, "auth": auth, "hosts": hosts, "addrs": addrs}


def _state(url: str, auth) -> tuple[dict, dict]:
    listing = httpx.get(f"{url}/workers", auth=auth, timeout=10).json()
    workers = {w["url"]: w for w in listing["workers"]}
    pairs = {(p["prefill"], p["decode"]): p for p in listing["pairs"]}
    return workers, pairs


def test_a_cut_link_unpairs_two_healthy_nodes_until_it_heals(cluster, tiny6):
    url, auth, hosts, addrs = cluster["url"], cluster["auth"], cluster["hosts"], cluster["addrs"]
    ref = hf_greedy(load_hf(tiny6), PROMPTS, MAX_NEW)
    p1, d1 = f"http://{addrs[0]}:30000", f"http://{addrs[2]}:30001"
    assert [generate(url, ids, MAX_NEW, API_KEY) for ids in PROMPTS] == ref
    _, pairs = _state(url, auth)
    assert {p["state"] for p in pairs.values()} == {"closed"}

    hosts[0].cut_link_to(addrs[2])
    hosts[2].cut_link_to(addrs[0])
    cut_at, sent = time.monotonic(), 0
    while pairs.get((p1, d1), {}).get("state") not in ("open", "half_open"):
        assert sent < 60, f"the cut pair never opened: {pairs}"  # P(never picked) < 1e-7
        i = sent % len(PROMPTS)
        assert generate(url, PROMPTS[i], MAX_NEW, API_KEY) == ref[i]  # none lost, none changed
        sent += 1
        workers, pairs = _state(url, auth)
    cut = pairs[(p1, d1)]
    assert cut["failures"] >= 1, pairs
    assert all(w["healthy"] for w in workers.values()), workers  # both nodes serve other pairs
    assert all(p["state"] == "closed" for k, p in pairs.items() if k != (p1, d1)), pairs

    # unpaired: the cut pair gets at most one trial per open period while requests flow
    before, start = cut["failures"], time.monotonic()
    assert [generate(url, ids, MAX_NEW, API_KEY) for ids in PROMPTS] == ref
    _, pairs = _state(url, auth)
    periods = 1 + int((time.monotonic() - start) / OPEN_S)
    assert pairs[(p1, d1)]["failures"] - before <= periods, pairs
    print(f"cut to unpaired and {len(PROMPTS)} more answered: {time.monotonic() - cut_at:.1f} s")

    hosts[0].heal()
    hosts[2].heal()
    deadline = time.monotonic() + 120
    while pairs[(p1, d1)]["state"] != "closed":
        assert time.monotonic() < deadline, pairs
        assert generate(url, PROMPTS[0], MAX_NEW, API_KEY) == ref[0]
        _, pairs = _state(url, auth)
    assert [generate(url, ids, MAX_NEW, API_KEY) for ids in PROMPTS] == ref
    assert all(p["state"] == "closed" for p in _state(url, auth)[1].values())
