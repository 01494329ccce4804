"""The prefill node's front: the node front plus the bootstrap server, and PD request admission.

`/generate` needs `bootstrap_room` (the router's 63-bit room, the same the decode node gets). The
answer comes once the prompt's KV reached the decode node (`prefill_done`) or failed (an error body,
502 for transfer/bootstrap failures so the router retries on a new pair)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from runtime.front import NodeFront, Pending, RequestError

ROOM_MAX = (1 << 63) - 1


def check_room(body: dict[str, Any]) -> int:
    room = body.get("bootstrap_room")
    if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room <= ROOM_MAX:
        raise RequestError(
            400, "'bootstrap_room' must be an integer in [0, 2^63)", "bootstrap_room"
        )
    return room


class PrefillFront(NodeFront):
    def __init__(self, *a, bootstrap_port: int, **kw):
        super().__init__(*a, **kw)
        self.bootstrap_port = bootstrap_port

    def extra_add_fields(self, body: dict[str, Any]) -> list[Any]:
        return [check_room(body)]

    def add_kind(self) -> str:
        return "pd_add"

    async def prefill_result(self, p: Pending) -> dict[str, Any]:
        try:
            while True:
                ev = await p.events.get()
                if ev[0] == "prefill_done":
                    p.done = True
                    p.t_first = time.monotonic()
                    self._observe(p, "prefill_done")
                    return {
                        "rid": p.rid,
                        "text": "",
                        "token_ids": [],
                        "meta_info": {
                            "prompt_tokens": p.prompt_tokens,
                            "cached_tokens": ev[3],
                            "finish_reason": {"type": "prefill_done"},
                        },
                    }
                if ev[0] == "error":
                    p.done = True
                    self._observe(p, "abort")
                    raise RequestError(
                        400 if ev[3] else 502, ev[2], ev[3], None if ev[3] else "prefill_failed"
                    )
        except asyncio.CancelledError:
            if not p.done and p.rid in self.pending:
                self.send(["abort", p.rid, "client disconnected"])
            raise

    def server_info(self) -> dict[str, Any]:
        info = super().server_info()
        info["bootstrap_port"] = self.bootstrap_port
        return info
