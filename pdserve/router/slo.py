"""SLO admission and goodput (opt-in: `--ttft-slo-ms`, `--itl-slo-ms`).

At admission the router predicts, with its latency model (router/routing/latency_model.py):
  TTFT  the earliest first token any route could give the request now: for each worker that can
        prefill it (a prefill node, plus its handoff; a decode node; a colocated node), its time
        for what the request's tenant waits behind in its queue (the nodes' fair order,
        latency_model.py `queue_ahead`), an equal share of the prompt tokens waiting in the
        router's queue ahead of the request, and the prompt;
  ITL   the decode step of the least loaded decode (or colocated) node with one more stream.
A request predicted past an SLO is refused at once: 429 `slo_unattainable`, with `Retry-After` the
seconds by which it would miss (at least 1). Without an SLO nothing is predicted or refused.

Goodput counts the generation requests answered in full within every SLO set: TTFT from arrival at
the router, mean ITL over the stream (a non-streamed answer: its whole time against TTFT + ITL per
further token).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pdserve.router.config import SloConfig
from pdserve.router.errors import ApiError

if TYPE_CHECKING:
    from pdserve.router.routing.dispatch import Dispatcher


class Slo:
    def __init__(self, cfg: SloConfig, dispatcher: Dispatcher):
        self.cfg, self.d = cfg, dispatcher

    @property
    def active(self) -> bool:
        return bool(self.cfg.ttft_ms or self.cfg.itl_ms)

    def predict_ttft_s(
        self,
        model: str | None,
        tokens: int,
        waiting_tokens: int,
        key: str = "",
        tenant: str | None = None,
    ) -> float | None:
        """None when no worker could prefill it now. A decode node counts as a place to prefill
        where the router would send it there (disagg.py): no prefill node, a short prompt, or the
        queue rule on; each worker is charged only what its prefix cache does not hold."""
        reg, disagg = self.d.registry, self.d.disagg
        m, cfg = disagg.model, disagg.cfg
        prefills, decodes = reg.serving(model, "prefill"), reg.serving(model, "decode")
        local_ok = not prefills or tokens < cfg.min_prompt_tokens or cfg.local_prefill_cost > 0
        workers = prefills + (decodes if local_ok else []) + reg.serving(model, "colocated")
        if not workers:
            return None
        share = waiting_tokens / len(workers)
        best = math.inf
        for w in workers:
            cache = disagg.prefill_cache if w.role == "prefill" else disagg.decode_cache
            todo = tokens - disagg.held_tokens(cache, key, w, tokens)
            if w.role != "prefill":
                t = m.local_ttft(w, todo, tenant, share)
            elif decodes:
                t = min(m.pd_ttft(w, d, todo, tokens, tenant, share) for d in decodes)
            else:
                continue
            best = min(best, t)
        return best if best < math.inf else None

    def predict_itl_s(self, model: str | None) -> float | None:
        reg, m = self.d.registry, self.d.disagg.model
        workers = reg.serving(model, "decode") or reg.serving(model, "colocated")
        return min((m.step_s(w, w.in_flight + 1) for w in workers), default=None)

    def check(
        self,
        model: str | None,
        tokens: int,
        waiting_tokens: int,
        key: str = "",
        running: int = 1,
        tenant: str | None = None,
    ) -> None:
        """Raises the typed 429 when the request is predicted to miss an SLO. With nothing
        running it is let through whatever the prediction: its measurement is how a model that
        predicts too much learns better (nothing else would ever run to correct it)."""
        if not running:
            return
        misses = []
        if self.cfg.ttft_ms:
            t = self.predict_ttft_s(model, tokens, waiting_tokens, key, tenant)
            if t is not None and t * 1e3 > self.cfg.ttft_ms:
                misses.append(("ttft", t * 1e3, self.cfg.ttft_ms))
        if self.cfg.itl_ms:
            t = self.predict_itl_s(model)
            if t is not None and t * 1e3 > self.cfg.itl_ms:
                misses.append(("itl", t * 1e3, self.cfg.itl_ms))
        if not misses:
            return
        for slo, _, _ in misses:
            self.d.metrics.slo_rejections.labels(slo=slo).inc()
        said = "; ".join(f"{s} predicted {p:.0f} ms > SLO {limit:g} ms" for s, p, limit in misses)
        over_s = max(p - limit for _, p, limit in misses) / 1e3
        raise ApiError(
            429,
            f"the request would miss its latency target now ({said}); retry later",
            type="rate_limit_error",
            code="slo_unattainable",
            headers={"Retry-After": str(max(1, math.ceil(over_s)))},
        )

    def met(self, ttft_s: float, itl_s: float | None) -> bool:
        ok_ttft = not self.cfg.ttft_ms or ttft_s * 1e3 <= self.cfg.ttft_ms
        ok_itl = not self.cfg.itl_ms or itl_s is None or itl_s * 1e3 <= self.cfg.itl_ms
        return ok_ttft and ok_itl

    def finished(self, ttft_s: float, itl_s: float | None) -> None:
        """A generation answered in full: counted as goodput when it met every SLO."""
        if self.met(ttft_s, itl_s):
            self.d.metrics.goodput.inc()

    def finished_whole(self, seconds: float, completion_tokens: int) -> None:
        """A non-streamed answer: only its whole time is known."""
        if not self.cfg.ttft_ms:  # an ITL alone cannot be told from the whole time
            self.d.metrics.goodput.inc()
            return
        budget_ms = self.cfg.ttft_ms + self.cfg.itl_ms * max(0, completion_tokens - 1)
        if seconds * 1e3 <= budget_ms:
            self.d.metrics.goodput.inc()
