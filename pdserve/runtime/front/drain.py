"""Draining a node: it stops being chosen, lets what it serves finish, hands the rest on, exits.

`Drain.start` (SIGTERM, or the authenticated `POST /drain`):
1. `/health` answers 200 with `"draining": true`: the router's next probe takes the node out of
   its choices (router/routing/workers.py) without counting it unhealthy, and the node still
   admits what was routed to it before that, so nothing is refused;
2. the node waits until nothing is pending, or the grace period (`--drain-grace`) ends;
3. what is left is aborted with `node_draining`: the router moves those streams to another node
   mid-stream (router/routing/migration.py) and retries the others from the start;
4. the server stops: the node stops its ranks and exits 0.
A second SIGTERM, or SIGINT, stops the node at once, as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from pdserve.runtime.reasons import AbortReason

log = logging.getLogger("pdserve.serve")

POLL_S = 0.1
ABORT_WAIT_S = 10.0  # after the grace period: how long the aborted requests may take to end


class Drain:
    def __init__(self, front: Any, grace_s: float, stop_server: Callable[[], None]):
        self.front, self.grace_s, self.stop_server = front, grace_s, stop_server
        self.task: asyncio.Task | None = None
        self.deadline: float | None = None

    def start(self, grace_s: float | None = None) -> dict[str, Any]:
        """Starts draining (once; a later call only reports). Runs on the event loop."""
        if self.task is None:
            grace = self.grace_s if grace_s is None else grace_s
            self.deadline = time.monotonic() + grace
            self.front.draining = True
            log.warning(
                "draining: %d requests pending, %g s to finish before they move",
                len(self.front.pending),
                grace,
            )
            self.task = asyncio.get_running_loop().create_task(self._run(), name="drain")
        return self.status()

    def status(self) -> dict[str, Any]:
        left = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
        return {
            "draining": self.task is not None,
            "pending": len(self.front.pending),
            "grace_left_s": None if left is None else round(left, 3),
        }

    async def _run(self) -> None:
        front = self.front
        assert self.deadline is not None
        while front.pending and time.monotonic() < self.deadline:
            await asyncio.sleep(POLL_S)
        # from here a new request is refused (a retryable 503: the router sends it elsewhere), and
        # whatever is still pending, late arrivals included, is aborted until nothing is
        front.refusing = "the node is draining"
        if front.pending:
            log.warning("draining: the grace period ended; %d requests move on", len(front.pending))
        await move_on(front)
        log.warning("drained: the node stops")
        self.stop_server()


async def move_on(front: Any, still: Callable[[], bool] = lambda: True) -> None:
    """Aborts what `front` holds with `node_draining`, each request once and in arrival order
    (late arrivals too), until nothing is pending, `still()` turns false, or ABORT_WAIT_S: the
    router moves the streams to another node mid-stream and retries the others. After a drain's
    grace, and after an elastic node's role-change grace (elastic_node/front.py)."""
    aborted: set[str] = set()
    end = time.monotonic() + ABORT_WAIT_S
    while front.pending and still() and time.monotonic() < end:
        for rid in [r for r in front.pending if r not in aborted]:  # arrival order
            front.abort(rid, AbortReason.NODE_DRAINING)
            aborted.add(rid)
        await asyncio.sleep(POLL_S)
