"""The router's HTTP surface: `build_app(config)` returns a FastAPI app with its own state.

Request path for the OpenAI endpoints: auth -> read JSON -> validate -> model/context checks ->
admission -> dispatch (retries inside) -> whole answer or SSE stream -> metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infra.internal_auth import bearer, bearer_ok
from router.admission import Admission, Rejected
from router.attempt import Attempt
from router.config import RouterConfig, WorkerSpec
from router.dispatch import Dispatcher
from router.json_body import read_json_body
from router.keepalive import native_error, openai_error, pinged_stream
from router.metrics import RouterMetrics
from router.node_clients import NodeClients
from router.openai_protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    native_prompt_key,
    parse_native,
    parse_request,
)
from router.openapi import openapi_document
from router.responses import StreamShaper, chat_completion, text_completion
from router.streams import native_stream, openai_stream
from router.workers import WorkerRegistry

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")


class Router:
    """Everything one app owns: HTTP client pool, workers, dispatcher, admission, metrics."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.clients = NodeClients(
            cfg.connect_timeout_s, cfg.max_concurrent, bearer(cfg.internal_token)
        )
        self.registry = WorkerRegistry(cfg, self.clients, self.metrics)
        for spec in cfg.workers:
            self.registry.add(spec)
        self.dispatcher = Dispatcher(cfg, self.registry, self.clients, self.metrics)
        self.admission = Admission(cfg.max_concurrent, cfg.max_queue, cfg.queue_timeout_s)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        await self.registry.probe_all()
        self.registry.start()
        logger.info(
            "router ready: %d workers, models %s", len(self.registry.all()), self.registry.models()
        )
        try:
            yield
        finally:
            await self.registry.stop()
            await self.dispatcher.drain()
            await self.clients.aclose()

    # --- request checks -----------------------------------------------------------------
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

    def check_context(self, max_new_tokens: int | None, field: str = "max_tokens") -> None:
        limit = self.registry.max_context()
        if limit and max_new_tokens and max_new_tokens >= limit:
            raise ApiError(
                400,
                f"{field}={max_new_tokens} leaves no room for the prompt in "
                f"the {limit}-token context",
                param=field,
                code="context_length_exceeded",
            )

    async def admit(self) -> None:
        try:
            await self.admission.acquire()
        except Rejected as exc:
            self.metrics.rejected.inc()
            raise ApiError(
                429,
                f"the router is at capacity ({exc}); retry later",
                type="rate_limit_error",
                code="router_overloaded",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            ) from None

    async def open_watched(
        self, request: Request, body: dict, key: str, stream: bool
    ) -> Attempt | asyncio.Task:
        """Dispatch; if the client disconnects before the answer opens, cancel (which aborts).
        A stream not open after `sse_keepalive_s`: the dispatch task, still running (the caller
        then sends keep-alives until it ends, router/keepalive.py)."""
        task = asyncio.create_task(self.dispatcher.open(body, key, stream))
        watcher = asyncio.create_task(_wait_disconnect(request))
        wait_s = self.cfg.sse_keepalive_s if stream and self.cfg.sse_keepalive_s > 0 else None
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

    # --- handlers ---------------------------------------------------------------------------
    async def serve(self, route: str, request: Request, handler) -> Response:
        """Run one handler; ApiError becomes an OpenAI error body; non-stream metrics here."""
        t0 = time.perf_counter()
        try:
            response = await handler(request, t0)
        except ApiError as exc:
            response = JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)
        if not isinstance(response, StreamingResponse):
            self.metrics.observe_request(route, response.status_code, time.perf_counter() - t0)
        return response

    async def openai(self, request: Request, t0: float, kind: str) -> Response:
        self.check_bearer(request, self.cfg.api_key, "API key")
        model_cls = ChatRequest if kind == "chat" else CompletionRequest
        req = parse_request(model_cls, await self.read_json(request))
        self.check_model(req.model)
        max_new = req.max_new_tokens() if kind == "chat" else req.max_tokens
        field = (
            "max_completion_tokens"
            if kind == "chat" and req.max_completion_tokens
            else "max_tokens"
        )
        self.check_context(max_new, field)
        native, key = req.to_native(), req.prompt_key()
        await self.admit()
        handed_over = False
        try:
            attempt = await self.open_watched(request, native, key, req.stream)

            def stream(attempt: Attempt):
                rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{attempt.rid}"
                shaper = StreamShaper(
                    kind,
                    rid,
                    req.model,
                    int(time.time()),
                    req.include_usage(),
                    req.wants_logprobs(),
                )
                return openai_stream(self, attempt, shaper, _ROUTES[kind], t0)

            if req.stream:
                handed_over = True
                gen = (
                    pinged_stream(self, attempt, _ROUTES[kind], t0, stream, openai_error)
                    if isinstance(attempt, asyncio.Task)
                    else stream(attempt)
                )
                return StreamingResponse(
                    gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
                )
            rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{attempt.rid}"
            created = int(time.time())
            build = chat_completion if kind == "chat" else text_completion
            try:
                answer = build(rid, req.model, created, attempt.result, req.wants_logprobs())
            finally:
                attempt.close(True)
            return JSONResponse(answer)
        finally:
            if not handed_over:
                self.admission.release()

    async def generate(self, request: Request, t0: float) -> Response:
        self.check_bearer(request, self.cfg.api_key, "API key")
        body = parse_native(await self.read_json(request))
        stream = bool(body.get("stream", False))
        await self.admit()
        handed_over = False
        try:
            attempt = await self.open_watched(request, body, native_prompt_key(body), stream)
            if isinstance(attempt, asyncio.Task):
                handed_over = True
                return StreamingResponse(
                    pinged_stream(
                        self,
                        attempt,
                        "/generate",
                        t0,
                        lambda a: native_stream(self, a, "/generate", t0),
                        native_error,
                    ),
                    media_type="text/event-stream",
                )
            if stream:
                handed_over = True
                return StreamingResponse(
                    native_stream(self, attempt, "/generate", t0), media_type="text/event-stream"
                )
            attempt.close(True)
            return JSONResponse(attempt.result)
        finally:
            if not handed_over:
                self.admission.release()

    async def add_worker(self, request: Request, t0: float) -> Response:
        self.check_bearer(request, self.cfg.internal_token, "internal token")
        body = await self.read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            raise ApiError(
                400,
                'send {"url": ..., "role": prefill|decode|colocated, '
                '"bootstrap_port": optional int}',
                param="url",
            )
        try:
            spec = WorkerSpec(
                url=body["url"],
                role=body.get("role", "decode"),
                bootstrap_port=body.get("bootstrap_port"),
            )
            worker = self.registry.add(spec)
        except (ValueError, TypeError) as exc:
            status = 409 if "already registered" in str(exc) else 400
            raise ApiError(status, str(exc), param="url") from None
        await self.registry.probe(worker)
        return JSONResponse({"worker": worker.describe()})

    async def remove_worker(self, request: Request, t0: float) -> Response:
        self.check_bearer(request, self.cfg.internal_token, "internal token")
        url = request.query_params.get("url")
        if not url:
            raise ApiError(400, "give the worker as DELETE /workers?url=...", param="url")
        try:
            worker = self.registry.remove(url)
        except KeyError:
            raise ApiError(404, f"no worker {url} is registered", param="url") from None
        return JSONResponse({"removed": worker.describe()})

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


_ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(config: RouterConfig) -> FastAPI:
    router = Router(config)
    app = FastAPI(
        title="pdserve router",
        lifespan=router.lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.router = router

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.serve(
            _ROUTES["chat"], request, lambda r, t0: router.openai(r, t0, "chat")
        )

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.serve(
            _ROUTES["completion"], request, lambda r, t0: router.openai(r, t0, "completion")
        )

    @app.post("/generate")
    async def generate(request: Request):
        return await router.serve("/generate", request, router.generate)

    @app.get("/v1/models")
    async def models(request: Request):
        async def handler(r: Request, t0: float) -> Response:
            router.check_bearer(r, config.api_key, "API key")
            data = [
                {"id": m, "object": "model", "created": 0, "owned_by": "pdserve"}
                for m in router.registry.models()
            ]
            return JSONResponse({"object": "list", "data": data})

        return await router.serve("/v1/models", request, handler)

    @app.get("/openapi.json")
    async def openapi(request: Request):
        async def handler(r: Request, t0: float) -> Response:
            router.check_bearer(r, config.api_key, "API key")
            return JSONResponse(
                openapi_document(
                    router.registry.models(),
                    router.registry.max_context(),
                    auth=bool(config.api_key),
                )
            )

        return await router.serve("/openapi.json", request, handler)

    @app.get("/health")
    async def health():
        return router.health()

    @app.get("/metrics")
    async def metrics():
        for worker in router.registry.all():
            router.registry.report(worker)
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.get("/workers")
    async def list_workers(request: Request):
        async def handler(r: Request, t0: float) -> Response:
            router.check_bearer(r, config.internal_token, "internal token")
            return JSONResponse({"workers": [w.describe() for w in router.registry.all()]})

        return await router.serve("/workers", request, handler)

    @app.post("/workers")
    async def add_worker(request: Request):
        return await router.serve("/workers", request, router.add_worker)

    @app.delete("/workers")
    async def remove_worker(request: Request):
        return await router.serve("/workers", request, router.remove_worker)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        body = {
            "error": {
                "message": str(exc.detail),
                "type": "invalid_request_error",
                "param": None,
                "code": None,
            }
        }
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        body = {
            "error": {
                "message": f"internal router error: {type(exc).__name__}",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
        return JSONResponse(body, status_code=500)

    return app
