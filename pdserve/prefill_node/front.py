"""The prefill node's front: the node front plus the bootstrap server, and PD request admission.

`/generate` needs `bootstrap_room` (the router's 63-bit room, the same the decode node gets). The
answer comes once the prompt's KV reached the decode node (`prefill_done`) or failed (an error body,
502 for transfer/bootstrap failures so the router retries on a new pair)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pdserve.engine.core import SamplingParams
from pdserve.pd_common.messages import PDAddRequest, PDRankSpec, PrefillDoneEvent, check_room
from pdserve.pd_common.metrics import PrefillMetrics
from pdserve.runtime.front.answer import Pending
from pdserve.runtime.front.process import NodeFront
from pdserve.runtime.front.prompt import RequestError
from pdserve.runtime.messages import ErrorEvent
from pdserve.runtime.reasons import AbortReason


class PrefillFront(NodeFront):
    finish_reasons = ("prefill_done", "abort")
    metrics_extension = PrefillMetrics
    rank_spec = PDRankSpec

    def __init__(self, *a, bootstrap_port: int, **kw):
        super().__init__(*a, **kw)
        self.bootstrap_port = bootstrap_port

    def add_request(
        self, rid: str, ids: list[int], params: SamplingParams, body: dict[str, Any]
    ) -> PDAddRequest:
        return PDAddRequest(rid, ids, params.to_dict(), check_room(body), "")

    async def answer(self, p: Pending) -> dict[str, Any]:
        return await prefill_answer(self, p)

    def describe(self) -> str:
        return f"KV bootstrap server on port {self.bootstrap_port}"

    def server_info(self) -> dict[str, Any]:
        info = super().server_info()
        info["bootstrap_port"] = self.bootstrap_port
        return info


async def prefill_answer(front: NodeFront, p: Pending) -> dict[str, Any]:
    """A prefill request's answer (the hand-off): once the prompt's KV reached the decode node, or
    its failure."""
    try:
        while True:
            ev = await p.events.get()
            if isinstance(ev, PrefillDoneEvent):
                p.done = True
                p.t_first = time.monotonic()
                front._observe(p, "prefill_done")
                return {
                    "rid": p.rid,
                    "text": "",
                    "token_ids": [],
                    "meta_info": {
                        "prompt_tokens": p.prompt_tokens,
                        "cached_tokens": ev.cached_len,
                        "finish_reason": {"type": "prefill_done"},
                    },
                }
            if isinstance(ev, ErrorEvent):
                p.done = True
                front._observe(p, "abort", ev.reason)
                if ev.reason == AbortReason.ROLE_CHANGE:  # an elastic node's: retried elsewhere
                    raise RequestError(503, ev.message, None, "role_change")
                code = None if ev.field else "prefill_failed"
                raise RequestError(400 if ev.field else 502, ev.message, ev.field, code)
    except asyncio.CancelledError:
        if not p.done and p.rid in front.pending:
            front.disconnected(p)
        raise
