"""The decode node's front: PD admission (the prefill node's bootstrap address and the room)."""
from __future__ import annotations

from typing import Any

from engine.node_front import NodeFront, RequestError

ROOM_MAX = (1 << 63) - 1


class DecodeFront(NodeFront):
    def extra_add_fields(self, body: dict[str, Any]) -> list[Any]:
        room, host, port = body.get("bootstrap_room"), body.get("bootstrap_host"), body.get("bootstrap_port")
        if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room <= ROOM_MAX:
            raise RequestError(400, "'bootstrap_room' must be an integer in [0, 2^63)", "bootstrap_room")
        if not isinstance(host, str) or not host or len(host) > 255:
            raise RequestError(400, "'bootstrap_host' (the prefill node's host) is required", "bootstrap_host")
        if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise RequestError(400, "'bootstrap_port' must be a TCP port", "bootstrap_port")
        return [room, f"{host}:{port}"]

    def add_kind(self) -> str:
        return "pd_add"
