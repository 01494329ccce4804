"""`pdserve up`'s rolling restart: SIGHUP to the launcher restarts every node of the running
cluster, one at a time, while the router keeps serving (docs/RELIABILITY.md).

For each node, prefill nodes first: the node drains (`POST /drain`, runtime/front/drain.py): the
router stops choosing it, its requests get the node's `--drain-grace` to finish, and the streams
left then move to another decode node mid-stream; once it has exited, the same command starts it
again on the same ports, and the next node waits until the router has it back (healthy, not
draining). A fresh rank zygote forks the new ranks, so the restarted nodes run the code installed
now (the old zygote, whose ranks no longer exist, stops at the end). Nothing is refused and no
stream breaks, as long as another node of the role is there to take over.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httpx

from pdserve.infra.request_signing import signed_auth
from pdserve.infra.zygote import ENV as ZYGOTE_ENV
from pdserve.infra.zygote_client import Zygote

if TYPE_CHECKING:
    from pdserve.up import Cluster

EXIT_MARGIN_S = 60.0  # beyond the grace period: a draining node's aborts and its ranks' stop
BACK_TIMEOUT_S = 300.0  # a restarted node loads its model again


def rolling_restart(cluster: Cluster, say) -> None:
    """Restarts every node of `cluster` in turn (see the module docstring); raises RuntimeError or
    TimeoutError naming the node where it stopped."""
    old = cluster.zygote
    cluster.zygote = Zygote.start(cluster.rank_modules)
    cluster.env[ZYGOTE_ENV] = cluster.zygote.path
    if old is not None:  # stopped with the cluster: ranks of nodes not restarted yet are its own
        cluster.retired_zygotes.append(old)
    auth = signed_auth(cluster.secret)
    order = sorted(cluster.nodes, key=lambda n: not n[0].startswith("prefill"))
    t0 = time.monotonic()
    for name, url in order:
        t = time.monotonic()
        proc = cluster.proc(name)
        say(f"rolling restart: draining {name}")
        resp = cluster.http.post(f"{url}/drain", json={}, auth=auth, timeout=10)
        if resp.status_code != 200:
            raise RuntimeError(f"{name} refused to drain: {resp.status_code} {resp.text[:200]}")
        try:
            code = proc.wait(timeout=resp.json().get("grace_left_s", 0) + EXIT_MARGIN_S)
        except Exception as e:
            raise TimeoutError(f"{name} did not exit after draining") from e
        cluster.respawn(name)
        _wait_back(cluster, name, url, auth)
        say(f"rolling restart: {name} back (exited {code}; {time.monotonic() - t:.1f} s)")
    if old is not None:  # every rank it forked is gone with its node
        cluster.retired_zygotes.remove(old)
        old.close()
    say(f"rolling restart done: {len(order)} nodes in {time.monotonic() - t0:.1f} s")


def _wait_back(cluster: Cluster, name: str, url: str, auth) -> None:
    """Until the router serves with the restarted node again."""
    deadline = time.monotonic() + BACK_TIMEOUT_S
    while True:
        if cluster.proc(name).poll() is not None:
            raise RuntimeError(f"{name} exited while it started again")
        try:
            workers = cluster.http.get(
                f"{cluster.router_url}/workers", auth=auth, timeout=5
            ).json()["workers"]
            mine = next((w for w in workers if w["url"] == url), None)
            if mine is not None and mine["healthy"] and not mine["draining"]:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not back in the router after {BACK_TIMEOUT_S:.0f} s")
        time.sleep(0.5)
