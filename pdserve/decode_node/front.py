"""The decode node's front: PD admission (the prefill node's bootstrap address and the room), and
decode-local requests: a body without any bootstrap field is prefilled on this node.

The bootstrap address comes in the request body, but the decode ranks contact it (with the cluster
secret), so the front admits only addresses on its allowlist: the prefill bootstrap servers the
router registered and pushed here through the authenticated PUT /bootstrap_servers. A request that
names any other address is refused (403) before anything is contacted."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from pdserve.engine.core import SamplingParams
from pdserve.pd_common.messages import PDAddRequest, PDRankSpec, check_room
from pdserve.pd_common.metrics import DecodeMetrics
from pdserve.runtime.front.http_app import read_json
from pdserve.runtime.front.process import NodeFront
from pdserve.runtime.front.prompt import RequestError
from pdserve.runtime.messages import AddRequest

MAX_BOOTSTRAP_SERVERS = 4096
BOOTSTRAP_FIELDS = ("bootstrap_room", "bootstrap_host", "bootstrap_port")


class DecodeFront(NodeFront):
    metrics_extension = DecodeMetrics
    rank_spec = PDRankSpec

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.bootstrap_servers: frozenset[str] = frozenset()

    def set_bootstrap_servers(self, body: dict[str, Any]) -> list[str]:
        """Replaces the allowlist with body["servers"] ("host:port" strings); returns it sorted."""
        servers = body.get("servers")
        if (
            not isinstance(servers, list)
            or len(servers) > MAX_BOOTSTRAP_SERVERS
            or not all(
                isinstance(s, str) and 0 < len(s) <= 262 and s.rpartition(":")[2].isdigit()
                for s in servers
            )
        ):
            raise RequestError(
                400,
                f"'servers' must be a list of at most {MAX_BOOTSTRAP_SERVERS} 'host:port' strings",
                "servers",
            )
        self.bootstrap_servers = frozenset(servers)
        return sorted(self.bootstrap_servers)

    def add_routes(self, app: Any, check_internal: Any) -> None:
        @app.put("/bootstrap_servers")
        async def bootstrap_servers(request: Request):
            """The prefill bootstrap servers this decode node may contact (the router keeps it
            current)."""
            check_internal(request)
            return {"servers": self.set_bootstrap_servers(await read_json(request))}

    def add_request(
        self, rid: str, ids: list[int], params: SamplingParams, body: dict[str, Any]
    ) -> AddRequest:
        if all(body.get(k) is None for k in BOOTSTRAP_FIELDS):
            # No prefill node named: this node prefills the prompt itself (the same engine and
            # scheduler, chunked and mixed with the running decode batch).
            if self.metrics is not None:
                self.metrics.ext.count_local_prompt(len(ids))
            return super().add_request(rid, ids, params, body)
        room = check_room(body)
        host, port = body.get("bootstrap_host"), body.get("bootstrap_port")
        if not isinstance(host, str) or not host or len(host) > 255:
            raise RequestError(
                400, "'bootstrap_host' (the prefill node's host) is required", "bootstrap_host"
            )
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise RequestError(400, "'bootstrap_port' must be a TCP port", "bootstrap_port")
        addr = f"{host}:{port}"
        if addr not in self.bootstrap_servers:
            raise RequestError(
                403,
                f"bootstrap server {addr} is not a prefill node registered with this "
                "cluster's router",
                "bootstrap_host",
                "unknown_bootstrap_server",
            )
        return PDAddRequest(rid, ids, params.to_dict(), room, addr)
