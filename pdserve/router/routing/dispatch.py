"""PD dispatch: pick a (prefill, decode) pair with the policies and open an attempt on it,
retrying failed attempts on new pairs with backoff, until one opens or retries run out.

Decode-only routes (a decode node prefills a request that names no prefill node): when no
prefill node serving the model is eligible, after an attempt whose prefill leg failed before the
client got a byte, or when conditional disaggregation (router/routing/disagg.py) finds the request
better prefilled on the decode node, the request goes to a decode node alone. A healthy decode node
is never idle while a client gets an error only a prefill node caused. Every route is counted in
`pdserve_router_route_decisions_total{path, reason}`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Callable

import httpx

from pdserve.infra.logs import bind_request
from pdserve.router.admission import ADMITTED
from pdserve.router.config import RouterConfig
from pdserve.router.errors import ApiError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.routing.attempt import Attempt, Failure, Route
from pdserve.router.routing.disagg import Disaggregation
from pdserve.router.routing.migration import ResumableStream
from pdserve.router.routing.node_clients import NodeClients
from pdserve.router.routing.pair_health import FAILURE_CODES_NOT_THE_LINK, PairHealth
from pdserve.router.routing.policies import make_policy
from pdserve.router.routing.workers import Worker, WorkerRegistry

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")


class Dispatcher:
    def __init__(
        self,
        cfg: RouterConfig,
        registry: WorkerRegistry,
        clients: NodeClients,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
    ):
        self.cfg, self.registry, self.clients, self.metrics = cfg, registry, clients, metrics
        self.policies = {
            "prefill": make_policy(cfg.prefill_policy, cfg.cache_aware),
            "decode": make_policy(cfg.decode_policy, cfg.cache_aware),
            "colocated": make_policy(cfg.decode_policy, cfg.cache_aware),
        }
        # headers of every request to a node; the secret is not one: the pooled clients sign
        # each request with it (NodeClients)
        self.node_headers: dict[str, str] = {}
        self.disagg = Disaggregation(cfg.disagg)
        self.pairs = PairHealth(cfg.pair_breaker, metrics)
        self._rng = rng or random.Random()
        self._background: set[asyncio.Task] = set()
        self.on_prefilled: Callable[[], None] = lambda: None  # a prompt left a node's queue

    # --- choosing -------------------------------------------------------------------------
    def _choose(
        self,
        role: str,
        key: str,
        exclude: set[str],
        model: str | None,
        usable: Callable[[Worker], bool] | None = None,
    ) -> Worker | None:
        eligible = self.registry.serving(model, role)
        if usable is not None:  # a hard filter, unlike `exclude`
            eligible = [w for w in eligible if usable(w)]
        fresh = [w for w in eligible if w.url not in exclude] or eligible
        return self.policies[role].select(fresh, key) if fresh else None

    def pick(
        self,
        key: str,
        exclude: set[str],
        model: str | None = None,
        prefill_failed: bool = False,
        body: dict | None = None,
        migrating: bool = False,
    ) -> Route:
        """A PD pair serving `model` (both halves), or its decode node alone when the request is
        better prefilled there (router/routing/disagg.py), no prefill node can serve it or a prefill
        leg of this request failed; else a colocated worker serving it."""
        ticket = ADMITTED.get()
        tenant = ticket.tenant if ticket is not None else ""  # as the nodes are told (attempt.py)
        if self.registry.has_role("prefill") or self.registry.has_role("decode"):
            decode, prefill = self._choose_pair(key, exclude, model, prefill_failed)
            if decode:
                body = body or {}
                chars = 0 if isinstance(body.get("input_ids"), list) else len(key)
                if prefill:
                    d = self.disagg.decide(body, key, prefill, decode, tenant)
                    path, reason, tokens = d.path, d.reason, d.prompt_tokens
                    predicted = d.predicted_ttft_s
                    reason = "migration" if migrating else reason
                else:
                    path, tokens = "decode_only", self.disagg.tokens.estimate(body, key)
                    predicted = self.disagg.model.local_ttft(decode, tokens, tenant)
                    reason = (
                        "migration"
                        if migrating
                        else "prefill_failed"
                        if prefill_failed
                        else "no_prefill"
                    )
                    if not prefill_failed and self.registry.serving(model, "prefill"):
                        reason = "pair_down"  # prefill nodes serve, none paired with this one
                keep = prefill if path == "disaggregated" else None
                self.disagg.routed(key, decode.url, keep.url if keep else None)
                self.metrics.route_decision(path, reason)
                return Route(keep, decode, tokens, chars, path, predicted, reason)
        colocated = self._choose("colocated", key, exclude, model)
        if colocated:
            tokens = self.disagg.tokens.estimate(body or {}, key)
            chars = 0 if isinstance((body or {}).get("input_ids"), list) else len(key)
            predicted = self.disagg.model.local_ttft(colocated, tokens, tenant)
            return Route(None, colocated, tokens, chars, "colocated", predicted)
        counts = ", ".join(
            f"{role}: {len(self.registry.serving(model, role))} of "
            f"{sum(w.role == role for w in self.registry.all())}"
            for role in ("prefill", "decode", "colocated")
        )
        what = f"model {model!r}" if model else "the request"
        raise ApiError(
            503,
            f"no healthy workers to serve {what} (eligible {counts})",
            type="server_error",
            code="no_available_workers",
        )

    def _choose_pair(
        self, key: str, exclude: set[str], model: str | None, prefill_failed: bool
    ) -> tuple[Worker | None, Worker | None]:
        """A decode node, preferring those with a usable pair (pair_health.py), and a prefill node
        usable with it (None: none is, or this request's prefill leg failed)."""
        prefills = [] if prefill_failed else self.registry.serving(model, "prefill")

        def paired(d: Worker) -> bool:
            return any(self.pairs.usable(p.url, d.url) for p in prefills)

        decode = (prefills and self._choose("decode", key, exclude, model, paired)) or None
        decode = decode or self._choose("decode", key, exclude, model)
        if decode is None or not prefills:
            return decode, None
        usable = lambda p: self.pairs.usable(p.url, decode.url)  # noqa: E731
        return decode, self._choose("prefill", key, exclude, model, usable)

    def _eligible(self, route: Route, model: str | None) -> bool:
        return all(
            w is None or w in self.registry.serving(model, w.role)
            for w in (route.prefill, route.decode)
        )

    def can_route(self) -> bool:
        """Whether `pick` would find a pair, a decode node alone or a colocated worker now (no
        policy is consulted)."""
        eligible = self.registry.eligible
        return bool(eligible("decode")) or bool(eligible("colocated"))

    def backoff(self, n: int) -> float:
        r = self.cfg.retry
        base = min(r.max_backoff_s, r.initial_backoff_s * r.multiplier**n)
        return base * (1 + self._rng.uniform(-r.jitter, r.jitter))

    # --- running --------------------------------------------------------------------------
    async def open(
        self,
        body: dict,
        key: str,
        stream: bool,
        model: str | None = None,
        follow: Route | None = None,
    ) -> Attempt | ResumableStream:
        """`open_attempt`; a stream comes back as a ResumableStream, which moves to another decode
        node when its own fails mid-stream (router/routing/migration.py)."""
        attempt = await self.open_attempt(body, key, stream, model, follow)
        return ResumableStream(self, attempt, body, key, model) if stream else attempt

    async def open_attempt(
        self,
        body: dict,
        key: str,
        stream: bool,
        model: str | None = None,
        follow: Route | None = None,
        exclude: set[str] | None = None,
        migrating: bool = False,
    ) -> Attempt:
        """Open an attempt on workers serving `model`, retrying on new pairs; raises ApiError when
        every try failed. `follow`: the first try's pair (an `n` > 1 choice goes where choice 0
        went, whose prompt is in that node's prefix cache), if both its workers are eligible.
        `exclude`: workers to avoid while others serve; `migrating`: a stream moving from a failed
        decode node (its body carries `resume`): the prompt and the tokens already sent are
        prefilled by the new decode node alone or by a prefill node, whichever the router
        predicts is faster (router/routing/disagg.py)."""
        exclude = set(exclude or ())
        n, last, prefill_failed = 0, None, False
        while True:
            try:
                route = (
                    follow
                    if n == 0 and follow is not None and self._eligible(follow, model)
                    else self.pick(key, exclude, model, prefill_failed, body, migrating)
                )
            except ApiError:
                if last is None:
                    raise
                raise last.to_api_error() from None  # the cause says more than "none left"
            attempt = Attempt(self, route, body, stream)
            bind_request(attempt.rid)  # this request's log lines carry its rid (JSON format)
            pair = (route.prefill.url, route.decode.url) if route.prefill is not None else None
            if pair is not None:
                self.pairs.on_dispatch(*pair)
            verdict: bool | None = None  # the pair's, settled once in `finally`
            try:
                await attempt.start()
                verdict = True
                return attempt
            except Failure as failure:
                verdict = None if failure.code in FAILURE_CODES_NOT_THE_LINK else False
                last = failure
                log = logger.warning if failure.status >= 500 else logger.info
                log("rid=%s attempt %d failed: %s", attempt.rid, n, failure.message)
                if not failure.retryable or n >= self.cfg.retry.max_retries:
                    raise failure.to_api_error() from None
                prefill_failed |= self._exclude_after(route, failure, exclude)
            finally:
                if pair is not None:
                    self.pairs.record(*pair, verdict)
            self.metrics.retries.inc()
            await asyncio.sleep(self.backoff(n))
            n += 1

    @staticmethod
    def _exclude_after(route: Route, failure: Failure, exclude: set[str]) -> bool:
        """What a failed try rules out for the next; True when its prefill leg failed (the
        decode side then prefills the retry itself)."""
        if route.prefill is not None and failure.culprit is route.prefill:
            exclude.add(route.prefill.url)
            return True
        # A new pair, not just a new culprit: a decode node reports a failed handoff (the prefill
        # node's bootstrap server unreachable, its rank silent) as its own abort, and cache_aware
        # would send the retry to the same prefill node again.
        exclude.update(w.url for w in (route.prefill, route.decode) if w is not None)
        return False

    def spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, worker: Worker, rid: str) -> None:
        try:
            client = self.clients.get(worker.url)
            resp = await client.post(
                f"{worker.url}/abort", json={"rid": rid}, headers=self.node_headers, timeout=5.0
            )
            logger.debug(
                "abort rid=%s on %s: %s", rid, worker.url, resp.status_code, extra={"rid": rid}
            )
        except httpx.HTTPError as exc:
            logger.warning(
                "abort rid=%s on %s failed: %r", rid, worker.url, exc, extra={"rid": rid}
            )

    async def drain(self, timeout: float = 3.0) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)
