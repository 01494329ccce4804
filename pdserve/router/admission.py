"""Admission control: at most `max_concurrent` units of work run, at most `max_queue` requests
wait for a turn.

A request costs what it sends to the nodes: one unit, or n for a request with `n` choices (n
node requests), capped at `max_concurrent` so that any request can run alone. `acquire(cost)`
either returns (the caller now holds `cost` units and must `release(cost)` exactly once) or raises
`Rejected` at once when the queue is full, or after `queue_timeout_s` in the queue. Waiters are
served in arrival order: a large request at the head waits until its units are free, and the
smaller ones behind it wait with it, so it is never starved.
"""

from __future__ import annotations

import asyncio
import collections


class Rejected(Exception):
    pass


class Admission:
    def __init__(self, max_concurrent: int, max_queue: int, queue_timeout_s: float):
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.running = 0  # units held
        self._waiting: collections.deque[tuple[asyncio.Future, int]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def cost(self, units: int) -> int:
        return max(1, min(units, self.max_concurrent))

    async def acquire(self, units: int = 1) -> None:
        units = self.cost(units)
        if self.running + units <= self.max_concurrent and not self._waiting:
            self.running += units
            return
        if len(self._waiting) >= self.max_queue:
            raise Rejected(f"{self.running} units running and {len(self._waiting)} queued")
        turn = asyncio.get_running_loop().create_future()
        entry = (turn, units)
        self._waiting.append(entry)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if turn.done():  # the units were handed over just as we gave up: pass them on
                self.release(units)
            else:
                self._waiting.remove(entry)
                turn.cancel()
                self._hand_over()  # a large request that gave up may unblock the ones behind it
            if isinstance(exc, asyncio.TimeoutError):
                raise Rejected(f"waited {self.queue_timeout_s:.0f} s in the queue") from None
            raise

    def release(self, units: int = 1) -> None:
        """Frees the units, then hands them to the oldest waiters that fit, in order."""
        self.running -= self.cost(units)
        assert self.running >= 0, "Admission.release() freed more than acquire() took"
        self._hand_over()

    def _hand_over(self) -> None:
        while self._waiting:
            turn, units = self._waiting[0]
            if turn.done():  # cancelled, about to remove itself
                self._waiting.popleft()
                continue
            if self.running + units > self.max_concurrent:
                return
            self._waiting.popleft()
            self.running += units
            turn.set_result(None)
