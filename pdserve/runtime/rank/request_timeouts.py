"""PP0's wall-clock request timeouts (docs/ARCHITECTURE.md section 7): a request queued longer than
the waiting timeout, or alive longer than the running timeout, becomes an `AbortRequest` in the meta
stream, so every rank aborts it at the same logical moment. The wall clock is read on PP0 only."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pdserve.runtime.messages import AbortRequest, AddRequest
from pdserve.runtime.reasons import AbortReason


class RequestTimeouts:
    """`waiting_s`, `running_s`: the two timeouts in seconds (0: off)."""

    def __init__(self, waiting_s: float, running_s: float):
        self.waiting_s, self.running_s = waiting_s, running_s
        self._arrived: dict[str, float] = {}  # rid -> monotonic arrival, for timeouts only

    def aborts(self, incoming: list[Any], phase: Callable[[str], str | None]) -> list[AbortRequest]:
        """The aborts for requests past a timeout; `incoming`: this iteration's messages (their
        requests arrive now), `phase(rid)`: "waiting", "running" or None (not known, or over)."""
        wt, rt = self.waiting_s, self.running_s
        if not (wt or rt):
            return []
        now = time.monotonic()
        for m in incoming:
            if isinstance(m, AddRequest):
                self._arrived[m.rid] = now
        out = []
        for rid, t0 in list(self._arrived.items()):
            where = phase(rid)
            if where is None:
                if all(m.rid != rid for m in incoming):
                    del self._arrived[rid]
                continue
            waited = now - t0
            if wt and where == "waiting" and waited > wt:
                out.append(AbortRequest(rid, AbortReason.WAITING_TIMEOUT))
            elif rt and waited > rt:
                out.append(AbortRequest(rid, AbortReason.RUNNING_TIMEOUT))
            else:
                continue
            del self._arrived[rid]
        return out
