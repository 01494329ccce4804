"""The router's HTTP surface: `build_app(config)` returns a FastAPI app with its own `Router`.

Every endpoint but /health and /metrics is a `handler(router, request, t0)` in
router/openai_api/generation.py or router/admin.py, run through `Router.serve` (OpenAI error bodies,
request metrics).
"""

from __future__ import annotations

import functools
import logging
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.infra.request_signing import SignatureCheck
from pdserve.router import admin, dashboard, timeline
from pdserve.router.config import RouterConfig
from pdserve.router.openai_api import generation
from pdserve.router.state import Router

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")

# (method, path, handler(router, request, t0))
ENDPOINTS = (
    ("POST", "/v1/chat/completions", functools.partial(generation.openai, kind="chat")),
    ("POST", "/v1/completions", functools.partial(generation.openai, kind="completion")),
    ("POST", "/generate", generation.generate),
    ("POST", "/tokenize", functools.partial(generation.tokenize, path="/tokenize")),
    ("POST", "/detokenize", functools.partial(generation.tokenize, path="/detokenize")),
    ("GET", "/v1/models", admin.models),
    ("GET", "/openapi.json", admin.openapi),
    ("GET", "/workers", admin.list_workers),
    ("POST", "/workers", admin.add_worker),
    ("DELETE", "/workers", admin.remove_worker),
    ("POST", "/workers/role", admin.change_role),
    ("GET", "/debug/requests", timeline.list_requests),
    ("GET", "/debug/requests/{id}", timeline.show_request),
    ("GET", "/dashboard", dashboard.page),
    ("GET", "/dashboard/state", dashboard.state),
)


def _error_body(message: str, type_: str) -> dict:
    return {"error": {"message": message, "type": type_, "param": None, "code": None}}


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
    # see Router.check_internal; a signed body is bounded like any other
    app.add_middleware(SignatureCheck, secret=config.internal_token, max_body=config.max_body_bytes)
    for method, path, handler in ENDPOINTS:

        async def endpoint(request: Request, path=path, handler=handler):
            return await router.serve(path, request, lambda r, t0: handler(router, r, t0))

        app.add_api_route(path, endpoint, methods=[method], name=f"{method} {path}")

    @app.get("/health")
    async def health():
        return router.health()

    @app.get("/metrics")
    async def metrics():
        for worker in router.registry.all():
            router.registry.report(worker)
        return Response(router.metrics.render(), media_type=router.metrics.content_type)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        body = _error_body(str(exc.detail), "invalid_request_error")
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        body = _error_body(f"internal router error: {type(exc).__name__}", "server_error")
        return JSONResponse(body, status_code=500)

    return app
