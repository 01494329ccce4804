"""The generation endpoints: /v1/chat/completions, /v1/completions, /generate, /tokenize and
/detokenize. Each is `handler(router, request, t0)`, run by `Router.serve`.

Path of an OpenAI request: auth -> read JSON -> validate -> model/context checks -> admission ->
dispatch (retries inside) -> whole answer or SSE stream -> metrics.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.router.errors import ApiError
from pdserve.router.openai_api import n_choices
from pdserve.router.openai_api import tokenize as tokenize_api
from pdserve.router.openai_api.keepalive import native_error, openai_error, pinged_stream
from pdserve.router.openai_api.protocol import ChatRequest, CompletionRequest
from pdserve.router.openai_api.request_parsing import native_prompt_key, parse_native, parse_request
from pdserve.router.openai_api.responses import Shape, StreamShaper, completion
from pdserve.router.openai_api.streams import native_stream, openai_stream
from pdserve.router.routing.attempt import Attempt
from pdserve.router.state import Router
from pdserve.router.tools import request as tool_request

ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def _shape(
    kind: str, req: ChatRequest | CompletionRequest, rid: str, plan: tool_request.ToolPlan | None
) -> Shape:
    return Shape(
        kind,
        f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{rid}",
        req.model,
        int(time.time()),
        req.wants_logprobs(),
        req.include_usage(),
        frozenset(req.stop_token_ids or ()),
        bool(req.return_tokens_as_token_ids),
        plan,
    )


def _client_field(exc: ApiError, native: str, client: str | None) -> ApiError:
    """A node's 400 naming a native field (`guide`) names the client's field that gave it."""
    err = exc.body.get("error") if isinstance(exc.body, dict) else None
    if client is None or not isinstance(err, dict) or err.get("param") != native:
        return exc
    message = str(err.get("message") or "")
    err["param"] = client
    err["message"] = client + message[len(native) :] if message.startswith(native) else message
    return exc


async def openai(router: Router, request: Request, t0: float, kind: str) -> Response:
    router.check_bearer(request, router.cfg.api_key, "API key")
    model_cls = ChatRequest if kind == "chat" else CompletionRequest
    req = parse_request(model_cls, await router.read_json(request))
    router.check_model(req.model)
    max_new = req.max_new_tokens() if kind == "chat" else req.max_tokens
    field = (
        "max_completion_tokens" if kind == "chat" and req.max_completion_tokens else "max_tokens"
    )
    router.check_context(req.model, max_new, field)
    native, key = req.to_native(), req.prompt_key()
    plan = (
        tool_request.apply(req, native, router.registry.tool_format(req.model))
        if kind == "chat"
        else None
    )
    try:
        if (req.n or 1) > 1:
            return await n_choices.serve(
                router,
                request,
                t0,
                native,
                key,
                req.model,
                req.n,
                req.stream,
                lambda rid: _shape(kind, req, rid, plan),
                ROUTES[kind],
            )
        return await _one_choice(router, request, t0, kind, req, native, key, plan)
    except ApiError as exc:
        # a guide the request's own fields did not give came from its tools (a forced call)
        guided = "guide" in native.get("sampling_params", {})
        client = req.guide_field() or ("tools" if guided else None)
        raise _client_field(exc, "guide", client) from None


async def _one_choice(
    router: Router,
    request: Request,
    t0: float,
    kind: str,
    req: ChatRequest | CompletionRequest,
    native: dict,
    key: str,
    plan: tool_request.ToolPlan | None,
) -> Response:
    await router.admit()
    handed_over = False
    try:
        attempt = await router.open_watched(request, native, key, req.stream, req.model)

        def stream(attempt: Attempt):
            shaper = StreamShaper(_shape(kind, req, attempt.rid, plan))
            return openai_stream(router, attempt, shaper, ROUTES[kind], t0)

        if req.stream:
            handed_over = True
            gen = (
                pinged_stream(router, attempt, ROUTES[kind], t0, stream, openai_error)
                if isinstance(attempt, asyncio.Task)
                else stream(attempt)
            )
            return StreamingResponse(
                gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            cached = await attempt.cached_tokens()
            answer = completion(_shape(kind, req, attempt.rid, plan), attempt.result, cached)
        finally:
            attempt.close(True)
        return JSONResponse(answer)
    finally:
        if not handed_over:
            router.admission.release()


async def generate(router: Router, request: Request, t0: float) -> Response:
    router.check_bearer(request, router.cfg.api_key, "API key")
    body = parse_native(await router.read_json(request))
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError(400, "model must be a string", param="model", code="invalid_value")
    model = router.default_model(body.get("model"))
    stream = bool(body.get("stream", False))
    await router.admit()
    handed_over = False
    try:
        attempt = await router.open_watched(request, body, native_prompt_key(body), stream, model)
        if isinstance(attempt, asyncio.Task):
            handed_over = True
            return StreamingResponse(
                pinged_stream(
                    router,
                    attempt,
                    "/generate",
                    t0,
                    lambda a: native_stream(router, a, "/generate", t0),
                    native_error,
                ),
                media_type="text/event-stream",
            )
        if stream:
            handed_over = True
            return StreamingResponse(
                native_stream(router, attempt, "/generate", t0), media_type="text/event-stream"
            )
        attempt.close(True)
        return JSONResponse(attempt.result)
    finally:
        if not handed_over:
            router.admission.release()


async def tokenize(router: Router, request: Request, t0: float, path: str) -> Response:
    router.check_bearer(request, router.cfg.api_key, "API key")
    body = await router.read_json(request)
    req = (
        tokenize_api.parse_tokenize(body)
        if path == "/tokenize"
        else parse_request(tokenize_api.Detokenize, body)
    )
    # admitted like a generation: it takes a node's tokenizer pool, which /generate shares
    await router.admit()
    try:
        return await tokenize_api.forward(
            router, path, router.default_model(req.model), tokenize_api.native(req)
        )
    finally:
        router.admission.release()
