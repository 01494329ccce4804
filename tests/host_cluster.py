"""A pdserve cluster over network-namespace hosts (tests/netns_hosts.py): the environment its
processes get, their command lines made by `pdserve launch` from the Helm chart's values (as the
chart's and compose's are, pdserve/launch.py), starting one command per host, waiting for the
router's workers, and greedy answers through the router. Used by tests/test_multi_host*.py."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import httpx
from netns_hosts import Hosts

from pdserve.infra.zygote import ENV as ZYGOTE_ENV

CHART_VALUES = Path(__file__).parents[1] / "deploy" / "helm" / "pdserve" / "values.yaml"


def host_env(secret: str, api_key: str, kv_timeout_s: float) -> dict[str, str]:
    """This environment for the hosts' processes, with the cluster secret, the router's API key,
    KV timeouts and the rank consensus checker on. Each host forks its own ranks: the tests' rank
    zygote lives in this namespace, and ranks it forked would too."""
    env = {k: v for k, v in os.environ.items() if k != ZYGOTE_ENV}
    timeout = str(kv_timeout_s)
    env |= {f"PDSERVE_KV_{k}_TIMEOUT_S": timeout for k in ("BOOTSTRAP", "WAITING", "TRANSFER")}
    env |= {"PDSERVE_RANK_CONSENSUS_CHECK": "1", "PDSERVE_INTERNAL_TOKEN": secret}
    env["PDSERVE_API_KEY"] = api_key
    return env


def launch_commands(
    values: dict, tmp: Path, plan: list[tuple[str, int, int, str]]
) -> list[list[str]]:
    """`pdserve launch` per host, for plan = (role, node index, node-rank, host address) of each:
    the chart's default values under `values` (a file in `tmp`), as `helm --set` would."""
    override = tmp / "values.json"
    override.write_text(json.dumps(values))  # JSON is YAML
    files = ["--values", str(CHART_VALUES), "--values", str(override)]
    return [
        ["launch", role, *files, "--host", host, "--node-index", str(i), "--node-rank", str(r)]
        for role, i, r, host in plan
    ]


def start(hosts: Hosts, commands: list[list[str]], logs: list[Path], env: dict[str, str]) -> None:
    """`pdserve <command>` on each host, in order."""
    for h, cmd, log in zip(hosts.hosts, commands, logs, strict=True):
        h.popen([sys.executable, "-m", "pdserve.cli", *cmd], log, env)


def wait_workers(
    url: str, auth, hosts: Hosts, logs: list[Path], count: int, timeout: float
) -> None:
    """Until the router lists `count` healthy workers; fails at once if a host's process exits."""
    deadline = time.monotonic() + timeout
    while True:
        dead = [h.name for h in hosts.hosts if any(p.poll() is not None for p in h.procs)]
        assert not dead, f"{dead} exited while starting: {_tails(logs)}"
        try:
            workers = httpx.get(f"{url}/workers", auth=auth, timeout=5).json()["workers"]
            if len(workers) == count and all(w["healthy"] for w in workers):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        assert time.monotonic() < deadline, f"not ready within {timeout:.0f} s: {_tails(logs)}"
        time.sleep(1)


def generate(url: str, ids: list[int], max_new: int, api_key: str) -> list[int]:
    """Greedy token ids through the router's native /generate."""
    body = {"input_ids": ids, "sampling_params": {"max_tokens": max_new, "ignore_eos": True}}
    headers = {"Authorization": f"Bearer {api_key}"}
    r = httpx.post(f"{url}/generate", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def _tails(logs: list[Path]) -> dict[str, str]:
    return {str(f): f.read_text()[-2000:] for f in logs if f.exists()}
