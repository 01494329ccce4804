"""The health of each (prefill, decode) pair, apart from either node's own: the link between two
nodes can fail while both stay healthy for every other pair (a partition, a broken route, a
firewall rule), and each node's breaker and health checks then see nothing wrong.

One circuit breaker per pair (router/routing/circuit.py, with `RouterConfig.pair_breaker`), fed by
the disaggregated attempts on that pair: an attempt that reached its first token closes it, one
that failed (a KV handoff that timed out, a transfer that broke, a node that aborted it) counts
against it; a busy node or a client's error says nothing about the link. `failure_threshold`
consecutive failures open it: the dispatcher pairs those two nodes no more and retries their
requests on another pair; after `open_s` one request tries the pair again (half-open), and a success
pairs them again. The state shows in /workers (`pairs`), the status page and
`pdserve_router_pair_circuit_state`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdserve.router.config import BreakerConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.routing.circuit import CircuitBreaker

Pair = tuple[str, str]  # (prefill URL, decode URL)
FAILURE_CODES_NOT_THE_LINK = ("node_busy", "node_rejected")


class PairHealth:
    def __init__(
        self,
        cfg: BreakerConfig,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._cfg, self._metrics, self._clock = cfg, metrics, clock
        self._breakers: dict[Pair, CircuitBreaker] = {}
        self._failures: dict[Pair, int] = {}

    def track(self, workers) -> None:
        """Every (prefill, decode) pair of `workers` gets its breaker (closed) and its metrics'
        series now, so they are exported before any request."""
        prefills = [w.url for w in workers if w.role == "prefill"]
        for decode in (w.url for w in workers if w.role == "decode"):
            for prefill in prefills:
                pair = (prefill, decode)
                if pair not in self._breakers:
                    self._breaker(pair)
                    self._metrics.pair_failures.labels(prefill=prefill, decode=decode)
                    self._report(pair)

    def usable(self, prefill: str, decode: str) -> bool:
        """Whether a new request may go to this pair now (no side effect)."""
        breaker = self._breakers.get((prefill, decode))
        return breaker is None or breaker.can_pass()

    def on_dispatch(self, prefill: str, decode: str) -> None:
        self._breaker((prefill, decode)).on_dispatch()
        self._report((prefill, decode))

    def record(self, prefill: str, decode: str, ok: bool | None) -> None:
        """Settles one dispatch: True (the pair did its part), False (it failed), None (no
        verdict on the link: a busy node, a client's error, a client gone). A pair forgotten
        since its dispatch (a worker removed while the request ran) is not made again: removed
        workers leave nothing behind."""
        pair = (prefill, decode)
        breaker = self._breakers.get(pair)
        if breaker is None:
            return
        breaker.record(ok)
        if ok is False:
            self._failures[pair] = self._failures.get(pair, 0) + 1
            self._metrics.pair_failures.labels(prefill=prefill, decode=decode).inc()
        self._report(pair)

    def state(self, prefill: str, decode: str) -> str:
        breaker = self._breakers.get((prefill, decode))
        return "closed" if breaker is None else breaker.state.name.lower()

    def describe(self) -> list[dict]:
        """Every pair of the registered workers, for /workers and the status page."""
        return [
            {
                "prefill": p,
                "decode": d,
                "state": self.state(p, d),
                "failures": self._failures.get((p, d), 0),
            }
            for p, d in sorted(self._breakers)
        ]

    def forget(self, url: str) -> None:
        """A worker was removed: its pairs go (a worker added again starts closed)."""
        for pair in [pair for pair in self._breakers if url in pair]:
            del self._breakers[pair]
            self._failures.pop(pair, None)
            self._metrics.forget_pair(*pair)

    def _breaker(self, pair: Pair) -> CircuitBreaker:
        breaker = self._breakers.get(pair)
        if breaker is None:
            breaker = self._breakers[pair] = CircuitBreaker(self._cfg, self._clock)
        return breaker

    def _report(self, pair: Pair) -> None:
        self._metrics.set_pair(*pair, self.state(*pair))
