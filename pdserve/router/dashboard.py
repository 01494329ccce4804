"""The router's live status page: `GET /dashboard` (one HTML page, no build step, no data in it)
and `GET /dashboard/state` (internal token), the JSON the page polls.

The state is what an operator asks first: every worker (role, health, breaker, load, the prompt
tokens queued for it), each of its ranks (KV pool use, queues, KV bytes moved; read from the
node's `/server_info` at that moment) and the router's own admission. Recent requests and their
stage waterfalls come from the router's timeline (`/debug/requests`, router/timeline.py), which the
page reads itself. The cluster secret is given to the page in the URL fragment
(`/dashboard#token=...`), which the browser never sends to any server, and kept in the tab's
sessionStorage.
"""

from __future__ import annotations

import asyncio
import time
from functools import cache
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

PAGE = Path(__file__).with_name("static") / "dashboard.html"
NODE_TIMEOUT_S = 2.0  # one slow node must not stall the page


@cache
def _page() -> str:
    return PAGE.read_text(encoding="utf-8")


async def page(router, request: Request, t0: float) -> Response:
    return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})


async def state(router, request: Request, t0: float) -> Response:
    router.check_internal(request)
    workers = router.registry.all()
    infos = await asyncio.gather(*(_server_info(router, w.url) for w in workers))
    return JSONResponse(
        {
            "time": time.time(),
            "router": {
                "running": router.admission.running,
                "waiting": router.admission.waiting,
                "max_concurrent": router.cfg.max_concurrent,
                "admission": router.admission.describe(),
                "slo": {"ttft_ms": router.cfg.slo.ttft_ms, "itl_ms": router.cfg.slo.itl_ms},
                "latency_model": router.dispatcher.disagg.model.describe(),
                # the elastic controller's targets, last look and moves (routing/elastic.py)
                "elastic": router.elastic.describe() if router.elastic is not None else None,
            },
            "workers": [
                {**w.describe(), "ranks": _ranks(info)}
                for w, info in zip(workers, infos, strict=True)
            ],
            "pairs": router.dispatcher.pairs.describe(),
        }
    )


def _ranks(info: dict | None) -> list[dict[str, Any]] | None:
    if info is None:
        return None
    out = []
    for r in info.get("ranks") or []:
        kv = r.get("kv") or {}
        out.append(
            {
                "pp_rank": r.get("pp_rank"),
                "num_pages": r.get("num_pages"),
                "held_pages": r.get("held_pages"),
                "cached_pages": r.get("cached_pages"),
                "free_pages": r.get("free_pages"),
                "queues": {
                    k: r[k]
                    for k in ("waiting", "running", "prealloc", "transfer", "bootstrap", "inflight")
                    if isinstance(r.get(k), int)
                },
                "kv_bytes": kv.get("bytes"),
            }
        )
    return out


async def _server_info(router, url: str) -> dict | None:
    try:
        resp = await router.clients.get(url).get(
            f"{url}/server_info", headers=router.dispatcher.node_headers, timeout=NODE_TIMEOUT_S
        )
        return resp.json() if resp.status_code == 200 else None
    except Exception:  # a dead or slow node shows as "no data", the page stays up
        return None
