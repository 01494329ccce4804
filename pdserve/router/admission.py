"""Admission control: at most `max_concurrent` requests run, at most `max_queue` wait for a turn.

`acquire()` either returns (the caller now holds a slot and must `release()` it exactly once) or
raises `Rejected` at once when the queue is full, or after `queue_timeout_s` in the queue.
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
        self.running = 0
        self._waiting: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self) -> None:
        if self.running < self.max_concurrent and not self._waiting:
            self.running += 1
            return
        if len(self._waiting) >= self.max_queue:
            raise Rejected(f"{self.running} requests running and {len(self._waiting)} queued")
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), self.queue_timeout_s)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if turn.done():  # the slot was handed over just as we gave up: pass it on
                self.release()
            else:
                self._waiting.remove(turn)
                turn.cancel()
            if isinstance(exc, asyncio.TimeoutError):
                raise Rejected(f"waited {self.queue_timeout_s:.0f} s in the queue") from None
            raise

    def release(self) -> None:
        """Give the slot to the oldest waiter, or free it."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # the slot moves over; `running` is unchanged
                return
        self.running -= 1
        assert self.running >= 0, "Admission.release() called more often than acquire()"
