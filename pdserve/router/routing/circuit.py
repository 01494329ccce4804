"""Per-worker circuit breaker: closed -> open -> half-open -> closed, fed by request outcomes."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

from pdserve.router.config import BreakerConfig


class CircuitState(enum.IntEnum):
    """The `state` label of `pdserve_router_circuit_state` is the name in lower case."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    """Contract:
    * `can_pass()` says whether a new request may go to the worker now; it has no side effect.
    * `on_dispatch()` must follow each request actually sent; every dispatch is later settled by
      exactly one `record(ok)` where ok is True (node did its part), False (node failed: connect
      error, 5xx, timeout) or None (no verdict: client error or client gone).
    * Closed: `failure_threshold` consecutive failures open it. Open: refuses everything for
      `open_s`, then is half-open. Half-open: one request at a time; `success_threshold` successes
      close it, one failure opens it again.
    """

    def __init__(self, cfg: BreakerConfig, clock: Callable[[], float] = time.monotonic):
        self._cfg = cfg
        self._clock = clock
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._successes = 0
        self._opened_at = 0.0
        self._probes = 0  # half-open requests in flight

    @property
    def state(self) -> CircuitState:
        if self._state is CircuitState.OPEN and self._clock() - self._opened_at >= self._cfg.open_s:
            self._state = CircuitState.HALF_OPEN
            self._successes = 0
            self._probes = 0
        return self._state

    def can_pass(self) -> bool:
        state = self.state
        if state is CircuitState.CLOSED:
            return True
        return state is CircuitState.HALF_OPEN and self._probes == 0

    def on_dispatch(self) -> None:
        if self.state is CircuitState.HALF_OPEN:
            self._probes += 1

    def record(self, ok: bool | None) -> None:
        state = self.state
        if state is CircuitState.HALF_OPEN:
            self._probes = max(0, self._probes - 1)
        if ok is None:
            return
        if state is CircuitState.CLOSED:
            self._failures = 0 if ok else self._failures + 1
            if self._failures >= self._cfg.failure_threshold:
                self._open()
        elif state is CircuitState.HALF_OPEN:
            if not ok:
                self._open()
            else:
                self._successes += 1
                if self._successes >= self._cfg.success_threshold:
                    self._state = CircuitState.CLOSED
                    self._failures = 0
        # OPEN: outcomes of requests sent before it opened change nothing.

    def _open(self) -> None:
        self._state = CircuitState.OPEN
        self._opened_at = self._clock()
        self._failures = 0
        self._successes = 0
        self._probes = 0
