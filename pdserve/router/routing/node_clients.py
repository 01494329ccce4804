"""HTTP connection pools to the nodes, sharded per node.

httpcore's pool scans every connection it holds for each request it assigns, so one pool holding
hundreds of connections spends most of the router's CPU there at high concurrency (measured with
`bench/bench_router.py`). Each node therefore gets `shards` small pools, used
in turn; every pool keeps its connections alive across requests.
"""

from __future__ import annotations

import itertools

import httpx

CONNECTIONS_PER_SHARD = 32


class _NodeTransport(httpx.AsyncHTTPTransport):
    """httpx's transport, with one library fault mapped to what it means. anyio 4.16 raises
    AttributeError ('NoneType' object has no attribute 'getpeername') from httpcore's connect when
    the node's socket closes under it (seen when a node is killed mid-connection): that is a
    connection error, and the router's handling of an unreachable node applies, not a 500."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            return await super().handle_async_request(request)
        except AttributeError as e:
            raise httpx.ConnectError(f"connection lost: {e}", request=request) from e


class NodeClients:
    def __init__(
        self, connect_timeout_s: float, max_concurrent: int, auth: httpx.Auth | None = None
    ):
        self._auth = auth  # signs every request to a node with the cluster secret
        self._timeout = httpx.Timeout(
            connect=connect_timeout_s, read=None, write=connect_timeout_s, pool=None
        )
        self._shards = max(1, -(-max_concurrent // CONNECTIONS_PER_SHARD))
        # One TLS context for every pool: a client built without one loads the CA bundle itself
        # (tens of ms of CPU), and a node's first request built 8 of them in the event loop.
        self._ssl = httpx.create_ssl_context()
        self._pools: dict[str, tuple[list[httpx.AsyncClient], itertools.cycle]] = {}

    def get(self, url: str) -> httpx.AsyncClient:
        """A client for requests to the node at `url` (use the same one for a whole exchange)."""
        entry = self._pools.get(url)
        if entry is None:
            clients = [
                httpx.AsyncClient(
                    timeout=self._timeout,
                    auth=self._auth,
                    transport=_NodeTransport(
                        verify=self._ssl,
                        # keep-alive below uvicorn's 5 s, so a pool never reuses a connection the
                        # node is closing
                        limits=httpx.Limits(
                            max_connections=None, max_keepalive_connections=64, keepalive_expiry=4.0
                        ),
                    ),
                )
                for _ in range(self._shards)
            ]
            entry = self._pools[url] = (clients, itertools.cycle(clients))
        return next(entry[1])

    async def aclose(self) -> None:
        for clients, _ in self._pools.values():
            for client in clients:
                await client.aclose()
        self._pools.clear()
