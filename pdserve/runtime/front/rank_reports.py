"""What a node's ranks report to its front, and what the front makes of it: every rank's stats
(pushed twice a second, sealed; runtime/rank/front_link.py StatsReporter), the node's health from
them (a rank that stopped reporting makes it unhealthy), and `/server_info`. A mixin of
`NodeFront` (runtime/front/process.py), whose state it reads."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.infra.channel_auth import AuthError
from pdserve.runtime.messages import RankStats, stats_sender, unpack

if TYPE_CHECKING:
    import zmq.asyncio

    from pdserve.infra.channel_auth import Opener
    from pdserve.runtime.front.answer import Pending
    from pdserve.runtime.front.metrics import NodeMetrics
    from pdserve.runtime.front.tracing import NodeTracing

log = logging.getLogger("pdserve.front")


class RankReports:
    # the state of NodeFront (runtime/front/process.py) that this mixin reads; NodeFront sets it
    model_name: str
    role: str
    pp_size: int
    max_context: int
    tool_call_format: str | None
    prefix_cache: bool
    sampling_defaults: dict[str, Any]
    pending: dict[str, Pending]
    rank_stats: dict[int, RankStats]
    follower_stats: dict[tuple[int, int], RankStats]  # (pp, tp): TP followers', for their `ext`
    rank_seen: dict[int, float]
    dead: str | None
    draining: bool
    metrics: NodeMetrics | None
    tracing: NodeTracing
    stats_sock: zmq.asyncio.Socket
    _stats_opener: Opener
    dropped: Counter[str]
    _drop: Callable[[str, Exception], None]

    def healthy(self, stale_s: float = 15.0) -> tuple[bool, str]:
        if self.dead:
            return False, self.dead
        now = time.monotonic()
        for r in range(self.pp_size):
            if r not in self.rank_seen:
                return False, f"pp_rank {r} is not ready yet"
            if now - self.rank_seen[r] > stale_s:
                return False, f"pp_rank {r} sent no stats for {now - self.rank_seen[r]:.0f} s"
        return True, "ok"

    async def _read_stats(self) -> None:
        while True:
            raw = await self.stats_sock.recv()
            try:
                self._on_stats(raw)
            except AuthError as e:
                self._drop(f"stats:{e.reason}", e)
            except Exception as e:
                self._drop("stats:malformed", e)

    def _on_stats(self, raw: bytes) -> None:
        sender, payload = self._stats_opener.open(raw)
        good, bad = unpack(payload)
        if bad or len(good) != 1 or not isinstance(good[0], RankStats):
            raise ValueError(f"not one RankStats: {bad[0] if bad else len(good)}")
        st = good[0]
        r = st.pp_rank
        if not 0 <= r < self.pp_size or sender != stats_sender(r, st.tp_rank):
            raise ValueError(f"stats of pp_rank {r!r} tp_rank {st.tp_rank!r} from {sender}")
        if st.tp_rank:  # a follower: its KV counters join its stage's series (metrics.py)
            self.follower_stats[r, st.tp_rank] = st
            return
        self.rank_stats[r] = st
        self.rank_seen[r] = time.monotonic()
        if st.spans:
            self.tracing.ingest(r, st.spans)
        if self.tracing.ending:
            self.tracing.sweep()
        if self.metrics is not None:
            try:
                self.metrics.ingest(st)
            except (TypeError, ValueError, KeyError) as e:
                log.warning("bad metric samples from pp_rank %d dropped: %s", r, e)

    def server_info(self) -> dict[str, Any]:
        ok, why = self.healthy()
        pp0 = self.rank_stats.get(0)
        return {
            "model": self.model_name,
            "role": self.role,
            "max_context": self.max_context,
            "tool_call_format": self.tool_call_format,
            "prefix_cache": self.prefix_cache,
            "pid": os.getpid(),
            # where this front runs (its node's I/O cores): a router on this host follows it there
            "front_cpus": sorted(os.sched_getaffinity(0)),
            "sampling_defaults": self.sampling_defaults,
            "pp_size": self.pp_size,
            "healthy": ok,
            "status": why,
            "draining": self.draining,
            "failed": self.dead or None,  # a rank exited: the node will not become healthy
            "load": {
                "running": pp0.queues.get("running", 0) if pp0 else 0,
                "waiting": pp0.queues.get("waiting", 0) if pp0 else 0,
                "in_flight": len(self.pending),
            },
            "ranks": [
                st.to_json() if (st := self.rank_stats.get(r)) else None
                for r in range(self.pp_size)
            ],
            "dropped_messages": dict(self.dropped),
            "threads": sorted({t.name for t in threading.enumerate()}),  # an exporter shows here
        }
