"""`pdserve register join|leave`: a node joins and leaves the routers' worker lists by itself, for
deployments whose node count an autoscaler changes (docs/DEPLOY.md "Autoscaling"; the Helm chart
runs it through `pdserve launch ROLE --register join|leave`, pdserve/launch.py).

join: waits until the node's front answers `GET /health` with 200, not draining (at most --wait
s), then registers it at every router that lacks it (`POST /workers {"url", "role",
"bootstrap_port", "replica"}`, after `GET /workers` says it is missing; `replica`: its pod's
ordinal, so the router's replicas gauge never asks a scale-down to stop a node it moved to the
other role). With --every S it looks again every S seconds while the node serves, so a router
that restarted, or a router replica added later, gets it back.

leave: removes the node from every router (`DELETE /workers?url=`), then asks the node to drain
(`POST /drain`), then holds until its front has stopped (at most --deadline s in all). The removal
comes first: from then on no router sends the node anything new, while what it holds goes on (a
router's open requests keep their node when it leaves the list); the drain then lets them finish
within the node's --drain-grace and aborts the rest with `node_draining`, which the router
migrates mid-stream to a node still on its list (router/routing/migration.py). The other order
keeps the node on the list until a router's next health probe sees it draining, so new requests
and even migrated streams still reach it and are aborted again at the end of the grace; and the
removal, after the drain, would have to wait for the node to stop.

Every router: the --router host is resolved to all its addresses (the chart's headless Service
names every router pod, ready or not: a router is not ready before it has nodes) and each one is
sent the request. Requests are signed with the cluster secret (PDSERVE_INTERNAL_TOKEN or
PDSERVE_INTERNAL_TOKEN_FILE, as every pdserve process reads it), each within --timeout, and one
that gets no answer, or a 5xx, is tried ATTEMPTS times.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import signal
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

URL_ENV = "PDSERVE_WORKER_URL"  # the URL the routers know this node by (the chart: its pod's name)
REPLICA_ENV = "PDSERVE_REPLICA"  # its index in its role's StatefulSet (the chart: the ordinal)
ATTEMPTS = 3  # tries of one request to one router or node
BACKOFF_S = 1.0  # before the second try; doubled before each later one
POLL_S = 1.0  # between health looks while a node starts or stops
HEALTH_TIMEOUT_S = 5.0  # one health look
RESOLVE_TIMEOUT_S = 10.0  # the router host's addresses
RETRY_S = 5.0  # join: the next look after a round that failed (--every after one that did not)
DEREGISTER_S = 20.0  # leave: the removal gives up after this, so the drain is asked for in time


class RegisterError(Exception):
    """A request that got no usable answer: says which and why."""


def say(msg: str) -> None:
    print(f"pdserve register: {msg}", file=sys.stderr, flush=True)


def add_register_args(ap: argparse.ArgumentParser) -> None:
    sub = ap.add_subparsers(dest="action", required=True)
    join = sub.add_parser("join", help="register the node with every router once it serves")
    leave = sub.add_parser("leave", help="remove the node from every router, then drain it")
    for p in (join, leave):
        p.add_argument(
            "--router", required=True, help="the routers' URL: each address of its host is one"
        )
        p.add_argument(
            "--node", required=True, help="the node's front from here, e.g. http://127.0.0.1:30000"
        )
        p.add_argument(
            "--url",
            default=os.environ.get(URL_ENV),
            help=f"the URL the routers know the node by (default: ${URL_ENV})",
        )
        p.add_argument("--timeout", type=float, default=15.0, help="seconds per request")
    join.add_argument("--role", required=True, choices=("prefill", "decode"))
    join.add_argument("--bootstrap-port", type=int, help="a prefill node's bootstrap port")
    join.add_argument(
        "--replica",
        default=os.environ.get(REPLICA_ENV),
        help=f"the node's index in its role's StatefulSet, which a scale-down stops from the "
        f"top (default: ${REPLICA_ENV}; none: not sent)",
    )
    join.add_argument(
        "--wait", type=float, default=600.0, help="seconds the node may take to serve first"
    )
    join.add_argument(
        "--every", type=float, default=0.0, help="look again every S seconds (0: once, then exit)"
    )
    leave.add_argument(
        "--deadline", type=float, default=90.0, help="seconds the whole leave may take"
    )


def register_main(args: argparse.Namespace) -> int:
    from pdserve.infra.cluster_secret import cluster_secret
    from pdserve.infra.request_signing import signed_auth

    if not args.url or not args.url.startswith(("http://", "https://")) or args.url[-1] == "/":
        say(f"error: give --url or ${URL_ENV} as http://HOST:PORT, not {args.url!r}")
        return 2
    replica = getattr(args, "replica", None)
    if replica not in (None, "") and not re.fullmatch(r"[0-9]{1,5}", str(replica)):
        say(f"error: give --replica or ${REPLICA_ENV} as an index in [0, 100000), not {replica!r}")
        return 2
    auth = signed_auth(cluster_secret())  # the secret signs each request; it is never sent
    with httpx.Client(auth=auth, timeout=args.timeout, trust_env=False) as client:
        if args.action == "leave":
            return leave(client, args)
        # the chart's sidecar is its container's PID 1, which ignores a SIGTERM it has no handler
        # for: the pod would wait out its whole grace period for it
        before = signal.signal(signal.SIGTERM, _exit)
        try:
            return join(client, args)
        finally:
            signal.signal(signal.SIGTERM, before)


def _exit(signum: int, frame: Any) -> None:
    raise SystemExit(0)


# --- join ------------------------------------------------------------------------------------
def join(client: httpx.Client, args: argparse.Namespace) -> int:
    deadline = time.monotonic() + args.wait
    while not serving(client, args.node):
        if time.monotonic() + POLL_S > deadline:
            say(f"error: {args.node} did not serve within {args.wait:g} s")
            return 1
        time.sleep(POLL_S)
    body: dict[str, Any] = {"url": args.url, "role": args.role}
    if args.bootstrap_port is not None:
        body["bootstrap_port"] = args.bootstrap_port
    if args.replica not in (None, ""):
        body["replica"] = int(args.replica)
    failed = register_everywhere(client, args.router, body)
    while args.every > 0:  # a sidecar's life: each look is bounded, the pod's end stops it
        time.sleep(min(args.every, RETRY_S) if failed else args.every)
        if serving(client, args.node):  # not while it drains, or restarts
            failed = register_everywhere(client, args.router, body)
    return 1 if failed else 0


def serving(client: httpx.Client, node: str) -> bool:
    """Whether the node's front answers /health 200 and is not draining (one look)."""
    try:
        resp = client.get(f"{node}/health", timeout=HEALTH_TIMEOUT_S)
        return resp.status_code == 200 and resp.json().get("draining") is not True
    except (httpx.HTTPError, ValueError, AttributeError):
        return False


def register_everywhere(client: httpx.Client, router: str, body: dict[str, Any]) -> int:
    """Registers the node at each router that lacks it; returns at how many that failed."""
    failed = 0
    for r in router_urls(router) or [router]:
        try:
            workers = _ok(_request(client, "GET", f"{r}/workers"), "GET /workers")
            if any(w.get("url") == body["url"] for w in workers.json().get("workers", [])):
                continue
            resp = _request(client, "POST", f"{r}/workers", json=body)
            if resp.status_code == 409:
                continue  # registered in between
            _ok(resp, "POST /workers")
            say(f"{body['url']} ({body['role']}) registered at {r}")
        except (RegisterError, ValueError, AttributeError) as e:
            say(f"error: {r}: {e}")
            failed += 1
    return failed


# --- leave -----------------------------------------------------------------------------------
def leave(client: httpx.Client, args: argparse.Namespace) -> int:
    start = time.monotonic()
    deadline = start + args.deadline
    failed = deregister_everywhere(
        client, args.router, args.url, min(deadline, start + DEREGISTER_S)
    )
    try:
        resp = _ok(_request(client, "POST", f"{args.node}/drain", deadline, json={}), "drain")
    except RegisterError as e:  # gone already, or still starting: nothing to hand on
        say(f"error: {args.node}: {e}")
        return 1
    say(f"{args.node} drains: {resp.text.strip()}")
    wait_stopped(client, args.node, deadline)
    return 1 if failed else 0


def deregister_everywhere(client: httpx.Client, router: str, url: str, deadline: float) -> int:
    """Removes the node from every router (404: not there, fine); returns at how many it failed."""
    failed = 0
    for r in router_urls(router) or [router]:
        try:
            resp = _request(client, "DELETE", f"{r}/workers", deadline, params={"url": url})
            if resp.status_code != 404:
                _ok(resp, "DELETE /workers")
                say(f"{url} removed from {r}")
        except RegisterError as e:
            say(f"error: {r}: {e}")
            failed += 1
    return failed


def wait_stopped(client: httpx.Client, node: str, deadline: float) -> None:
    """Until the node's front refuses connections (its drain is over: it stops its ranks and
    exits, and the SIGTERM that follows this hook finds nothing in flight), or the deadline."""
    while time.monotonic() < deadline:
        try:
            left = deadline - time.monotonic()
            client.get(f"{node}/health", timeout=max(0.1, min(HEALTH_TIMEOUT_S, left)))
        except httpx.ConnectError:
            say(f"{node} stopped serving")
            return
        except httpx.HTTPError:
            pass  # busy, or closing: look again
        time.sleep(max(0.0, min(POLL_S, deadline - time.monotonic())))
    say(f"{node} still up at the deadline")


# --- requests --------------------------------------------------------------------------------
def router_urls(router: str, timeout_s: float = RESOLVE_TIMEOUT_S) -> list[str]:
    """`router` once per address of its host (each pod behind a headless Service); as given for
    an address or https (whose certificate names the host). Empty when the name does not
    resolve (within `timeout_s`)."""
    url = httpx.URL(router.rstrip("/"))
    if url.scheme != "http" or _is_address(url.host):
        return [str(url)]
    pool = ThreadPoolExecutor(1)
    try:
        infos = pool.submit(
            socket.getaddrinfo, url.host, url.port or 80, type=socket.SOCK_STREAM
        ).result(timeout_s)
    except (OSError, TimeoutError) as e:
        say(f"error: cannot resolve {url.host}: {e!r}")
        return []
    finally:
        pool.shutdown(wait=False)
    return [str(url.copy_with(host=a)) for a in sorted({str(i[4][0]) for i in infos})]


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def _request(
    client: httpx.Client, method: str, url: str, deadline: float | None = None, **kw: Any
) -> httpx.Response:
    """The first answer under 500 of at most ATTEMPTS tries (none started past `deadline`)."""
    why = "no time left"
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            break
        timeout = client.timeout if left is None else httpx.Timeout(min(_seconds(client), left))
        try:
            resp = client.request(method, url, timeout=timeout, **kw)
        except httpx.HTTPError as e:
            why = f"{type(e).__name__}: {e}"
            continue
        if resp.status_code < 500:
            return resp
        why = f"{resp.status_code} {_message(resp)}"
    raise RegisterError(f"{method} {url}: {why}")


def _seconds(client: httpx.Client) -> float:
    return client.timeout.read or HEALTH_TIMEOUT_S


def _ok(resp: httpx.Response, what: str) -> httpx.Response:
    if resp.status_code != 200:
        raise RegisterError(f"{what}: {resp.status_code} {_message(resp)}")
    return resp


def _message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]
