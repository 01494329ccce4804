"""`Router`: what one router app owns (workers, dispatcher, admission, metrics) and the checks every
endpoint shares (bearer, JSON body, model, context, admission, client disconnect)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.infra.internal_auth import bearer_ok
from pdserve.infra.request_signing import is_signed, signed_auth
from pdserve.infra.tracing import make_exporter
from pdserve.router.admission import ADMITTED, Admission, Demand, Rejected, Ticket
from pdserve.router.config import RouterConfig
from pdserve.router.errors import ApiError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_api.json_body import read_json_body
from pdserve.router.routing.attempt import Attempt, Route
from pdserve.router.routing.dispatch import Dispatcher
from pdserve.router.routing.elastic import ElasticController
from pdserve.router.routing.node_clients import NodeClients
from pdserve.router.routing.workers import WorkerRegistry
from pdserve.router.slo import Slo
from pdserve.router.tenants import Tenants, read_tenant_keys
from pdserve.router.timeline import CURRENT, RequestTrace, Timeline, now_ns

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")


class Router:
    """Everything one app owns: HTTP client pool, workers, dispatcher, admission, metrics."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.clients = NodeClients(
            cfg.connect_timeout_s, cfg.max_concurrent, signed_auth(cfg.internal_token)
        )
        self.registry = WorkerRegistry(cfg, self.clients, self.metrics)
        for spec in cfg.workers:
            self.registry.add(spec)
        self.dispatcher = Dispatcher(cfg, self.registry, self.clients, self.metrics)
        self.dispatcher.pairs.track(self.registry.all())
        fair = cfg.fairness
        keys = read_tenant_keys(fair.tenant_keys_file) if fair.tenant_keys_file else ()
        self.tenants = Tenants(cfg.api_key, keys)
        self.admission = Admission(
            cfg.max_concurrent,
            cfg.max_queue,
            cfg.queue_timeout_s,
            fair.tenant_max_concurrent,
            self.tenants.weights,
            fair.max_queued_prompt_tokens,
            self.registry.queued_prompt_tokens,
        )
        # a prompt that leaves a node's queue may let a request held for the backlog through
        self.dispatcher.on_prefilled = self.admission.poke
        self.slo = Slo(cfg.slo, self.dispatcher)
        self.elastic = (
            ElasticController(
                cfg.elastic,
                cfg.slo,
                self.registry,
                self.dispatcher.disagg.model,
                self.metrics,
                on_moved=lambda: self.dispatcher.pairs.track(self.registry.all()),
            )
            if cfg.elastic.enabled
            else None
        )
        self.timeline = Timeline(
            cfg.debug_requests, make_exporter(cfg.otlp_traces_endpoint, "router")
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await self.registry.probe_all()
        self.registry.start()
        if self.elastic is not None:
            self.elastic.start()
        logger.info(
            "router ready: %d workers, models %s", len(self.registry.all()), self.registry.models()
        )
        try:
            yield
        finally:
            if self.elastic is not None:
                await self.elastic.stop()
            await self.registry.stop()
            await self.dispatcher.drain()
            await self.clients.aclose()
            self.timeline.close()

    # --- request checks -----------------------------------------------------------------
    def check_internal(self, request: Request) -> None:
        """The operator endpoints: a request signed with the cluster secret (`pdserve trace`, a
        script with infra/request_signing.py), or its bearer token, which an operator's own
        client sends; no process of the cluster sends it (docs/SECURITY.md)."""
        if is_signed(request, self.cfg.internal_token):
            return
        self.check_bearer(request, self.cfg.internal_token, "internal token")

    def check_bearer(self, request: Request, secret: str | None, what: str) -> None:
        if not bearer_ok(request.headers.get("authorization"), secret):
            raise ApiError(
                401,
                f"missing or wrong {what} (send 'Authorization: Bearer ...')",
                code="invalid_api_key",
            )

    async def read_json(self, request: Request):
        return await read_json_body(request, self.cfg.max_body_bytes)

    def check_model(self, model: str) -> None:
        known = self.registry.models()
        if known and model not in known:
            raise ApiError(
                404,
                f"model {model!r} does not exist; served: {', '.join(known)}",
                param="model",
                code="model_not_found",
            )

    def check_context(
        self, model: str, max_new_tokens: int | None, field: str = "max_tokens"
    ) -> None:
        limit = self.registry.max_context(model)
        if limit and max_new_tokens and max_new_tokens >= limit:
            raise ApiError(
                400,
                f"{field}={max_new_tokens} leaves no room for the prompt in "
                f"the {limit}-token context",
                param=field,
                code="context_length_exceeded",
            )

    def check_priority(self, priority: int) -> None:
        """vLLM's rule: a priority other than 0 needs priority scheduling turned on."""
        if priority and not self.cfg.fairness.priority_scheduling:
            raise ApiError(
                400,
                "priority: priority scheduling is off on this router (--priority-scheduling)",
                param="priority",
                code="invalid_value",
            )

    def check_api_key(self, request: Request) -> str:
        """The request's tenant (router/tenants.py), or 401 when it lacks a key that is required."""
        tenant = self.tenants.identify(request.headers.get("authorization"))
        if tenant is None:
            raise ApiError(
                401,
                "missing or wrong API key (send 'Authorization: Bearer ...')",
                code="invalid_api_key",
            )
        return tenant

    async def admit(
        self,
        tenant: str,
        body: dict | None = None,
        key: str = "",
        model: str | None = None,
        units: int = 1,
        priority: int = 0,
        generation: bool = True,
    ) -> Ticket:
        """Holds `units` of admission (a request's node requests: its `n`) or raises a typed 429
        (the queue is full, or the request is predicted to miss its SLO, router/slo.py); the caller
        releases the ticket exactly once. `generation` False (/tokenize, /detokenize): no SLO, and
        nothing charged to the nodes' prefill queues."""
        trace, t0 = CURRENT.get(), now_ns()
        self.check_priority(priority)
        prompt = self.dispatcher.disagg.tokens.estimate(body or {}, key)
        limit = self.registry.max_context(model) or 1 << 20
        output = min(_max_new_tokens(body or {}), limit)
        cost = min(prompt, limit) + units * output
        demand = Demand(units, tenant, priority, cost, prompt if generation else 0)
        try:
            if self.slo.active and generation:
                waiting = self.admission.queued_prompt_tokens(priority)
                self.slo.check(model, prompt, waiting, key, self.admission.running, tenant)
            ticket = await self.admission.acquire(demand)
            ADMITTED.set(ticket)  # the dispatch's tasks copy it (router/routing/attempt.py)
            if trace is not None:
                trace.add("router.admission_queue", t0, now_ns(), tenant=tenant)
            return ticket
        except (Rejected, ApiError) as exc:
            if trace is not None:
                trace.add("router.admission_queue", t0, now_ns(), tenant=tenant, rejected=str(exc))
            self.metrics.rejected.inc()
            if isinstance(exc, ApiError):
                raise
            raise ApiError(
                429,
                f"the router is at capacity ({exc}); retry later",
                type="rate_limit_error",
                code="router_overloaded",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            ) from None

    async def open_watched(
        self,
        request: Request,
        body: dict,
        key: str,
        stream: bool,
        model: str | None,
        follow: Route | None = None,
        keepalive: bool = True,
    ) -> Attempt | asyncio.Task:
        """Dispatch; if the client disconnects before the answer opens, cancel (which aborts).
        A stream not open after `sse_keepalive_s` (when `keepalive`): the dispatch task, still
        running (the caller then sends keep-alives until it ends, router/openai_api/keepalive.py).
        `follow`: the pair to try first (Dispatcher.open)."""
        task = asyncio.create_task(self.dispatcher.open(body, key, stream, model, follow))
        watcher = asyncio.create_task(wait_disconnect(request))
        ping = stream and keepalive and self.cfg.sse_keepalive_s > 0
        wait_s = self.cfg.sse_keepalive_s if ping else None
        timed_out = False
        try:
            done, _ = await asyncio.wait(
                {task, watcher}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED
            )
            timed_out = not done
        finally:
            watcher.cancel()
            if not task.done() and not timed_out:
                task.cancel()
                await asyncio.wait({task})  # cancel() only asks; its cleanup closes and aborts
        if timed_out:
            return task
        client_left = watcher.done() and not watcher.cancelled()
        if task.cancelled() or client_left:
            if not task.cancelled() and task.exception() is None:
                task.result().close(None, abort=True)  # it opened just as the client left
            raise ApiError(499, "client closed the request", code="client_closed")
        return task.result()

    # --- running a handler ------------------------------------------------------------------
    async def serve(self, route: str, request: Request, handler) -> Response:
        """Run one handler; ApiError becomes an OpenAI error body; non-stream metrics here."""
        t0 = time.perf_counter()
        trace = self.timeline.start(route, request)
        try:
            response = await handler(request, t0)
        except ApiError as exc:
            response = JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)
        except BaseException:
            if trace is not None:
                self.timeline.end(trace, 500)
            raise
        if trace is not None:
            self._end_trace(trace, response)
        if not isinstance(response, StreamingResponse):
            self.metrics.observe_request(route, response.status_code, time.perf_counter() - t0)
        return response

    def _end_trace(self, trace: RequestTrace, response: Response) -> None:
        """The trace ends with the answer: now, or when a stream's last byte went out."""
        if not isinstance(response, StreamingResponse):
            self.timeline.end(trace, response.status_code)
            return
        inner = response.body_iterator

        async def traced():
            try:
                async for chunk in inner:
                    yield chunk
            finally:
                self.timeline.end(trace, response.status_code)

        response.body_iterator = traced()

    def default_model(self, model: str | None) -> str | None:
        """`model` as given (checked), or the one served when it is left out (None: unknown yet)."""
        if model is not None:
            self.check_model(model)
            return model
        known = self.registry.models()
        if len(known) > 1:
            raise ApiError(
                400, f"model: give one of {', '.join(known)}", param="model", code="invalid_value"
            )
        return known[0] if known else None

    def health(self) -> Response:
        status, code = ("ok", 200) if self.dispatcher.can_route() else ("unavailable", 503)
        roles = {
            role: {
                "eligible": len(self.registry.eligible(role)),
                "total": sum(w.role == role for w in self.registry.all()),
            }
            for role in ("prefill", "decode", "colocated")
        }
        return JSONResponse({"status": status, "workers": roles}, status_code=code)


def _max_new_tokens(body: dict, default: int = 256) -> int:
    """The output tokens a native body asks for (its cost to the decode pool); `default` when it
    leaves them to the context."""
    params = body.get("sampling_params")
    value = params.get("max_tokens") if isinstance(params, dict) else None
    good = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if good else default


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
