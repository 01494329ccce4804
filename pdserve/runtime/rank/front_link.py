"""A rank's link to its node's front: PP0's end of the request and event channels
(`ZmqFrontIO`), and the stats every rank pushes to the front twice a second (`StatsReporter`),
which are also the front's liveness signal. Every message is sealed with the cluster secret
(infra/channel_auth.py) and bounded in size."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgpack
import zmq

from pdserve.infra.channel_auth import AuthError, Opener, Sealer, limit_size
from pdserve.runtime.front.process import (
    EVT_CHANNEL,
    EVT_MAX_BYTES,
    REQ_CHANNEL,
    REQ_MAX_BYTES,
    STATS_CHANNEL,
    STATS_MAX_BYTES,
)
from pdserve.runtime.messages import RankStats, StatsExtension, decode, pack, stats_sender
from pdserve.runtime.rank.slot_loop import RankLoop
from pdserve.runtime.rank_spec import RankSpec

log = logging.getLogger("pdserve.rank")


class ZmqFrontIO:
    """PP0's end of the front link: requests in (PULL), events out (PUSH); both sealed with the
    cluster secret (infra/channel_auth.py). Bad requests are dropped, counted and logged once."""

    def __init__(self, ctx: zmq.Context, req_addr: str, evt_addr: str):
        self.pull = ctx.socket(zmq.PULL)
        limit_size(self.pull, REQ_MAX_BYTES)
        self.pull.connect(req_addr)
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.SNDHWM, 0)
        limit_size(self.push, EVT_MAX_BYTES)
        self.push.connect(evt_addr)
        self._opener, self._sealer = Opener(REQ_CHANNEL), Sealer(EVT_CHANNEL, "pp0")
        self.dropped: dict[str, int] = {}

    def _drop(self, reason: str, err: object) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if self.dropped[reason] == 1:
            log.warning(
                "message from the front dropped (%s): %s; further ones are only counted",
                reason,
                err,
            )

    def poll(self, timeout_ms: int) -> list[Any]:
        out: list[Any] = []
        if not self.pull.poll(timeout_ms):
            return out
        while True:
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = decode(msgpack.unpackb(self._opener.open(raw)[1], raw=False))
            except AuthError as e:
                self._drop(e.reason, e)
                continue
            except Exception as e:  # the front is ours, but never trust bytes from a socket
                self._drop("malformed", e)
                continue
            out.append(msg)

    def report(self, events: list[Any]) -> None:
        self.push.send(self._sealer.seal(pack(events)))


def rank_stats(
    loop: RankLoop, pp_rank: int, ext: StatsExtension | None = None, dtype: str = ""
) -> RankStats:
    """What one rank reports to the front (and the in-process tests read directly)."""
    s, alloc = loop.sched, loop.sched.allocator
    cache = s.cache
    sliding = s.window_pages.allocator if s.window_pages is not None else None
    return RankStats(
        pp_rank=pp_rank,
        pid=os.getpid(),
        iterations=loop.stats.iterations,
        forwards=loop.stats.forwards,
        held_pages=s.held_pages(),
        used_tokens=s.used_tokens,
        num_pages=alloc.num_pages,
        free_pages=alloc.num_free,
        page_size=s.cfg.page_size,
        cached_pages=cache.num_cached_pages if cache else 0,
        locked_cached_pages=cache.num_cached_pages - cache.evictable_pages if cache else 0,
        prefix_hit_tokens=cache.hit_tokens_total if cache else 0,
        retractions=s.num_retractions,
        queues=loop.queue_sizes(),
        samples=loop.drain_samples(),
        front_dropped=dict(getattr(loop.front, "dropped", None) or {}),
        ext=ext,
        dtype=dtype,
        spans=loop.spans.drain(),
        sliding_pages=sliding.num_pages if sliding else 0,
        sliding_free_pages=sliding.num_free if sliding else 0,
    )


def follower_stats(spec: RankSpec, ext: StatsExtension | None) -> RankStats:
    """What a TP follower pushes: its own KV transfer counters (`ext`), the one thing the front
    reads of it (its lead's stats say the rest for the stage, its lead times and traces the
    requests); no walk over its pool or prefix cache, which would stall its TP group's next
    collective on every push."""
    return RankStats(
        pp_rank=spec.pp_rank,
        pid=os.getpid(),
        iterations=0,
        forwards=0,
        held_pages=0,
        used_tokens=0,
        num_pages=0,
        free_pages=0,
        page_size=0,
        cached_pages=0,
        locked_cached_pages=0,
        prefix_hit_tokens=0,
        retractions=0,
        queues={},
        samples={},
        ext=ext,
        tp_rank=spec.tp_rank,
    )


class StatsReporter:
    def __init__(
        self,
        ctx: zmq.Context,
        addr: str,
        spec: RankSpec,
        loop: RankLoop,
        period_s: float = 0.5,
        dtype: str = "",
    ):
        self.sock = ctx.socket(zmq.PUSH) if addr else None
        if self.sock is not None:
            self.sock.setsockopt(zmq.SNDHWM, 16)
            self.sock.setsockopt(zmq.LINGER, 0)
            limit_size(self.sock, STATS_MAX_BYTES)
            self.sock.connect(addr)
            self._sealer = Sealer(STATS_CHANNEL, stats_sender(spec.pp_rank, spec.tp_rank))
        self.spec, self.loop, self.period, self.dtype = spec, loop, period_s, dtype
        self._next = 0.0

    def maybe_send(self, force: bool = False) -> None:
        now = time.monotonic()
        if now < self._next and not force:
            return
        self._next = now + self.period
        if self.sock is None:  # no front: what it kept for a push goes
            self.loop.drain_samples()
            self.loop.spans.drain()
            return
        if self.spec.tp_rank:  # a follower: what it kept for a push goes, as above
            self.loop.drain_samples()
            self.loop.spans.drain()
            stats = follower_stats(self.spec, self.loop.stats_extension())
        else:
            ext = self.loop.stats_extension()
            stats = rank_stats(self.loop, self.spec.pp_rank, ext, self.dtype)
        self._send(stats)

    def _send(self, stats: RankStats) -> None:
        assert self.sock is not None  # maybe_send sends only with a socket
        try:
            self.sock.send(self._sealer.seal(pack([stats])), zmq.NOBLOCK)
        except zmq.Again:
            pass
