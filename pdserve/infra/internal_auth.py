"""Bearer checks (the router's API key, and an operator's own calls to the router's internal
endpoints), and refusing to listen unprotected.

The cluster's own internal calls (router -> nodes, ranks -> bootstrap server, `pdserve up` and
`pdserve trace`) never send the secret: they are signed with it (infra/request_signing.py). A
bearer value is compared in constant time, so the answer's timing tells nothing about how much of
a guess was right.
"""

from __future__ import annotations

import hmac
import ipaddress
import socket


def bearer_ok(header: str | None, secret: str | None) -> bool:
    """True when no secret is configured, or `header` is exactly 'Bearer <secret>'."""
    if not secret:
        return True
    return hmac.compare_digest((header or "").encode(), f"Bearer {secret}".encode())


def is_loopback(host: str, resolve: bool = True) -> bool:
    """True when `host` (an address or a name) is reachable only from this machine. `resolve`:
    whether another name is looked up (a blocking DNS call; an event loop passes False)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not resolve:
        return False
    try:
        # the address is a str for AF_INET and AF_INET6 (typeshed adds (int, bytes) for a Python
        # built without IPv6); str() of a str is the same str
        addrs = {str(ai[4][0]) for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs)


def refuse_unprotected_bind(host: str, secret: str | None, insecure: bool, what: str) -> None:
    """Stops the process (one line) when `what` would listen beyond loopback without a secret."""
    if secret or insecure or is_loopback(host):
        return
    raise SystemExit(
        f"{what}: refusing to bind {host} without a cluster secret; set PDSERVE_INTERNAL_TOKEN "
        f"or PDSERVE_INTERNAL_TOKEN_FILE (a 0600 file), or pass --insecure to serve "
        f"unauthenticated internal endpoints on a network you trust"
    )


INSECURE_HELP = (
    "serve the internal endpoints without a cluster secret on a non-loopback address: anyone who "
    "can reach the port can then generate, abort and read the topology (only for a private, "
    "trusted network)"
)
