"""What the latency model (latency_model.py) learns from one attempt's times: the prefill's
duration against the tokens its node computed before it ended, the handoff, and the seconds between
a stream's tokens against the decode node's open streams, also apart from the node's own prefills
(the elastic controller's decode step)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.router.routing.latency_model import queue_ahead

if TYPE_CHECKING:
    from pdserve.router.routing.attempt import Route
    from pdserve.router.routing.dispatch import Dispatcher


class Timing:
    """An attempt's times (monotonic seconds), and what the latency model learns from them: the
    prefill's duration against the tokens its node computed before it ended, the handoff, the
    seconds between tokens against the decode node's open streams."""

    def __init__(self) -> None:
        self.t_sent = self.t_prefilled = self.t_first = self.t_last = 0.0
        self.queue_ahead = 0.0  # prompt tokens it waited behind at the prefilling worker
        self.busy = False  # the prefilling worker had requests open when sent
        self.streams = 0  # requests open on the decode node at the first token
        self.tokens = 0  # stream events after the first
        self.handoff_learnt = False
        # the decode node prefilled no prompt of its own while this stream ran: no other's was
        # queued there at its first token, and none joined before its end
        self.clean = False
        self.prompts_seen = 0  # the decode node's prompts_queued at the first token

    def sent(self, route: Route, tenant: str) -> None:
        worker = route.prefill or route.decode
        self.t_sent = time.monotonic()
        self.queue_ahead = queue_ahead(worker, tenant, route.prompt_tokens)
        self.busy = worker.in_flight > 0

    def prefilled(self, d: Dispatcher, route: Route) -> None:
        self.t_prefilled = time.monotonic()
        assert route.prefill is not None
        work = self.queue_ahead + route.prompt_tokens
        d.disagg.model.observe_prefill(
            route.prefill.url, "prefill", False, work, self.t_prefilled - self.t_sent
        )
        self._handoff(d, route)

    def first_token(self, d: Dispatcher, route: Route) -> None:
        self.t_first = self.t_last = time.monotonic()
        decode = route.decode
        self.streams = decode.in_flight
        own = route.prompt_tokens if route.prefill is None else 0  # uncharged after this
        self.clean = decode.queued_prompt_tokens - own <= 0
        self.prompts_seen = decode.prompts_queued
        ttft = self.t_first - self.t_sent
        model = d.disagg.model
        if route.prefill is None:
            work = self.queue_ahead + route.prompt_tokens
            model.observe_prefill(route.decode.url, route.decode.role, self.busy, work, ttft)
        self._handoff(d, route)
        if (predicted := route.predicted_ttft_s) is not None:
            ratio = model.record_error(route.path, predicted, ttft, route.prompt_tokens)
            if ratio is not None:
                d.metrics.prediction_ratio.labels(path=route.path).observe(ratio)

    def _handoff(self, d: Dispatcher, route: Route) -> None:
        """Once both the prefill's answer and the first token came (in either order)."""
        if self.t_prefilled and self.t_first and not self.handoff_learnt:
            self.handoff_learnt = True
            gap = self.t_first - self.t_prefilled
            d.disagg.model.observe_handoff(route.decode.url, route.prompt_tokens, gap)

    def token(self) -> None:
        self.t_last = time.monotonic()
        self.tokens += 1

    def ended(self, d: Dispatcher, route: Route) -> None:
        if self.tokens >= 2:
            step = (self.t_last - self.t_first) / self.tokens
            clean = self.clean and route.decode.prompts_queued == self.prompts_seen
            d.disagg.model.observe_step(route.decode.url, self.streams, step, prefills=not clean)
