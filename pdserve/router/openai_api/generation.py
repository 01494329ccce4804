"""The generation endpoints: /v1/chat/completions, /v1/completions, /generate, /tokenize and
/detokenize. Each is `handler(router, request, t0)`, run by `Router.serve`.

Path of an OpenAI request: auth -> read JSON -> validate -> model/context checks -> admission ->
dispatch (retries inside) -> whole answer or SSE stream -> metrics.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.admission import Ticket
from pdserve.router.errors import ApiError
from pdserve.router.openai_api import n_choices
from pdserve.router.openai_api import tokenize as tokenize_api
from pdserve.router.openai_api.keepalive import native_error, openai_error, pinged_stream
from pdserve.router.openai_api.owned_stream import OwnedStream, abandon
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
    tenant = router.check_api_key(request)
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
                tenant,
                req.priority or 0,
            )
        ticket = await router.admit(tenant, native, key, req.model, 1, req.priority or 0)
        return await _one_choice(router, request, t0, kind, req, native, key, plan, ticket)
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
    ticket: Ticket,
) -> Response:
    handed_over = False
    try:
        attempt = await router.open_watched(request, native, key, req.stream, req.model)

        def stream(attempt: Attempt):
            shaper = StreamShaper(_shape(kind, req, attempt.rid, plan))
            return openai_stream(router, attempt, shaper, ROUTES[kind], t0, ticket)

        if req.stream:
            handed_over = True
            if isinstance(attempt, asyncio.Task):
                gen = pinged_stream(router, attempt, ROUTES[kind], t0, stream, openai_error, ticket)
                left = abandon(router, ROUTES[kind], t0, ticket, opening=attempt)
            else:
                gen, left = stream(attempt), abandon(router, ROUTES[kind], t0, ticket, [attempt])
            return OwnedStream(gen, left, headers={"Cache-Control": "no-cache"})
        try:
            cached = await attempt.cached_tokens()
            answer = completion(_shape(kind, req, attempt.rid, plan), attempt.result, cached)
        finally:
            attempt.close(True)
        router.slo.finished_whole(time.perf_counter() - t0, _completion_tokens(attempt.result))
        return JSONResponse(answer)
    finally:
        if not handed_over:
            ticket.release()


async def generate(router: Router, request: Request, t0: float) -> Response:
    tenant = router.check_api_key(request)
    body = parse_native(await router.read_json(request))
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise ApiError(400, "model must be a string", param="model", code="invalid_value")
    model = router.default_model(body.get("model"))
    stream = bool(body.get("stream", False))
    key = native_prompt_key(body)
    ticket = await router.admit(tenant, body, key, model)
    handed_over = False
    try:
        attempt = await router.open_watched(request, body, key, stream, model)
        if isinstance(attempt, asyncio.Task):
            handed_over = True
            return OwnedStream(
                pinged_stream(
                    router,
                    attempt,
                    "/generate",
                    t0,
                    lambda a: native_stream(router, a, "/generate", t0, ticket),
                    native_error,
                    ticket,
                ),
                abandon(router, "/generate", t0, ticket, opening=attempt),
            )
        if stream:
            handed_over = True
            return OwnedStream(
                native_stream(router, attempt, "/generate", t0, ticket),
                abandon(router, "/generate", t0, ticket, [attempt]),
            )
        attempt.close(True)
        router.slo.finished_whole(time.perf_counter() - t0, _completion_tokens(attempt.result))
        return JSONResponse(attempt.result)
    finally:
        if not handed_over:
            ticket.release()


async def tokenize(router: Router, request: Request, t0: float, path: str) -> Response:
    tenant = router.check_api_key(request)
    body = await router.read_json(request)
    req = (
        tokenize_api.parse_tokenize(body)
        if path == "/tokenize"
        else parse_request(tokenize_api.Detokenize, body)
    )
    # admitted like a generation: it takes a node's tokenizer pool, which /generate shares
    body_cost = {"sampling_params": {"max_tokens": 1}}
    ticket = await router.admit(tenant, body_cost, _text_of(body), generation=False)
    try:
        return await tokenize_api.forward(
            router, path, router.default_model(req.model), tokenize_api.native(req)
        )
    finally:
        ticket.release()


def _text_of(body) -> str:
    """What a /tokenize or /detokenize body asks to be worked on, for its cost estimate."""
    if not isinstance(body, dict):
        return ""
    value = body.get("prompt", body.get("messages", body.get("tokens", "")))
    return value if isinstance(value, str) else str(value)[:1_000_000]


def _completion_tokens(result: dict | None) -> int:
    meta = (result or {}).get("meta_info") or {}
    value = meta.get("completion_tokens") if isinstance(meta, dict) else None
    return value if isinstance(value, int) else 1
