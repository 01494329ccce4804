"""A node's waiting queue, in fair order between tenants.

The router orders its own queue fairly (router/admission.py), but what it lets through lands here:
without an order of its own, a node would prefill in arrival order, and a tenant that floods it
with long prompts would put every other tenant's prompt behind all of its own. So the queue orders
requests as the router does, by weighted fair queuing on prompt tokens:

    start  = max(clock, finish of the tenant's previous request)
    finish = start + tokens / weight          (tokens: prompt + resumed output, what it prefills)
    order  = (priority, finish, arrival)      clock = the start tag of the last request admitted

One tenant alone gets arrival order: its finish tags grow with arrival. A retracted request keeps
its tags (it was charged once), so it goes back ahead of the requests that came after it.

Every rank holds its own queue and must order it alike, so the tags are a pure function of the
replicated inputs (the `Share` each request carries, its length, the order of adds and
admissions): no clock, no rank-local state. Floating point is deterministic here, as the same
operations run in the same order on every rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from pdserve.engine.core import Req, ReqStatus

MAX_TENANTS_KEPT = 4096  # beyond this, tenants whose tag no longer matters are forgotten


def _key(r: Req) -> tuple:
    return r.fair_key


class FairQueue:
    def __init__(self) -> None:
        self._reqs: list[Req] = []  # sorted by fair_key
        self.clock = 0.0  # virtual time
        self._finish: dict[str, float] = {}  # tenant -> finish tag of its last request

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

    def push(self, req: Req, arrival: int) -> None:
        """Queues a new request: tags it after its tenant's earlier requests."""
        share = req.share
        start = max(self.clock, self._finish.get(share.tenant, 0.0))
        finish = start + req.seq_len / share.weight
        self._finish[share.tenant] = finish
        self._forget_idle()
        req.fair_key = (share.priority, finish, arrival, start)
        bisect.insort(self._reqs, req, key=_key)

    def requeue(self, req: Req) -> None:
        """Puts a retracted request back, in its old place in the order; one that never waited
        here (a PD decode, whose prompt came as KV) is tagged now, as it re-prefills."""
        if not req.fair_key:
            self.push(req, req.arrival)
            return
        bisect.insort(self._reqs, req, key=_key)

    def head(self) -> Req:
        return self._reqs[0]

    def pop_head(self) -> Req:
        """The first request in order, admitted: virtual time moves to its start."""
        req = self._reqs.pop(0)
        self.clock = max(self.clock, req.fair_key[3])
        return req

    def remove(self, req: Req) -> None:
        """Takes out a request that leaves while waiting (an abort). One that never ran gives its
        tenant back what it was charged, so an aborted flood does not count against it."""
        self._reqs.remove(req)
        if req.status is ReqStatus.WAITING and req.share.tenant in self._finish:
            _, finish, _, start = req.fair_key
            self._finish[req.share.tenant] -= finish - start

    def _forget_idle(self) -> None:
        """Bounds the tag map, the same way on every rank. A tenant whose finish tag is at or
        behind the clock would start at the clock anyway: forgetting it changes nothing. If that
        is not enough (many tenants, each owed a little), the ones owed least are forgotten: the
        next request of each starts at the clock, a little early."""
        if len(self._finish) <= MAX_TENANTS_KEPT:
            return
        clock = self.clock
        self._finish = {t: f for t, f in self._finish.items() if f > clock}
        if len(self._finish) > MAX_TENANTS_KEPT:
            kept = sorted(self._finish.items(), key=lambda tf: (tf[1], tf[0]))
            self._finish = dict(kept[-(MAX_TENANTS_KEPT // 2) :])
