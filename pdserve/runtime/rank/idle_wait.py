"""How long PP0 waits for the front's next message when it has nothing to schedule.

Each iteration wakes every rank of the node (the meta goes round the ring), so a node that polls
fast for nothing pays for it on every rank: a node with one PD room waiting for its partner,
polling every 5 ms, took a large share of a core on a 2-core host (measured: bench/results/
HISTORY.md, "What limits a 2-core machine"), which the other node's ranks there lose. So the wait
backs off:
- idle (no request at all): 5, 10, 20 ... up to 250 ms; a request still wakes PP0 at once, so
  this costs no latency;
- only outstanding work (PD rooms in bootstrap, transfer, release or quarantine, which move by
  messages from outside the ring): 5, 10, then 20 ms while nothing changes, back to 5 ms when
  something does (`SlotLoop.outstanding`: a queue's size, or a room's transfer status, such as KV
  that landed), so a landed transfer is seen within 20 ms and the votes on it run at 5 ms;
- work to schedule: no wait.
The wait is timing only: it decides when PP0 looks, never what any rank decides.
"""

from __future__ import annotations

from collections.abc import Hashable


class IdleWait:
    def __init__(self, first_ms: int = 5, idle_max_ms: int = 250, outstanding_max_ms: int = 20):
        if not 0 < first_ms <= min(idle_max_ms, outstanding_max_ms):
            raise ValueError(
                f"first_ms {first_ms} must be > 0 and at most the caps "
                f"({idle_max_ms}, {outstanding_max_ms})"
            )
        self.first_ms, self.idle_max_ms = first_ms, idle_max_ms
        self.outstanding_max_ms = outstanding_max_ms
        self.ms = 0  # the current wait
        self._seen: Hashable = None  # the outstanding work's state at the last wait

    def next(self, busy: bool, outstanding: Hashable | None) -> int:
        """The next wait in ms. `busy`: there is work to schedule; `outstanding`: None (nothing
        waits outside the scheduler) or a value that changes when that work moves (queue sizes)."""
        if busy:
            self.ms = 0
        elif outstanding is not None:
            if outstanding != self._seen:
                self.ms = self.first_ms
            else:
                self.ms = min(max(2 * self.ms, self.first_ms), self.outstanding_max_ms)
        else:
            self.ms = min(max(2 * self.ms, self.first_ms), self.idle_max_ms)
        self._seen = outstanding
        return self.ms

    def woken(self) -> None:
        """A message arrived: the next wait starts from the shortest again."""
        self.ms = 0
