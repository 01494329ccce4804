"""The HTTP surface of a node front (docs/PROTOCOL.md): /generate, /abort, /tokenize, /detokenize,
/health, /server_info, /metrics, and a front's own endpoints (NodeFront.add_routes: the decode
node's /bootstrap_servers).

Everything but /health and /metrics needs the cluster secret (when the node has one): they are what
a load balancer's probe and a Prometheus scraper read, and they tell nothing a request could
abuse."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from pdserve.infra.logs import bind_request
from pdserve.infra.request_signing import SignatureCheck, is_signed
from pdserve.infra.sse import sse
from pdserve.runtime.front import tokenize as node_tokenize
from pdserve.runtime.front.process import OVERLOADED, NodeFront
from pdserve.runtime.front.prompt import RID_MAX, RequestError

MAX_BODY = 4 * 1024 * 1024
BODY_TIMEOUT_S = 30.0  # to receive a whole body once its headers are in
# Tokenisation and chat templates run here, off the event loop; one thread, because a fast
# tokenizer used from several threads at once can fail ("Already borrowed").
TOKENIZER_POOL = ThreadPoolExecutor(1, thread_name_prefix="tokenize")


async def read_body(request: Request, limit: int = MAX_BODY) -> bytes:
    """The body, refused (413) as soon as its declared or received size passes `limit`: an oversized
    body is never held in memory."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body over {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise RequestError(413, f"request body over {limit} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestError(
            408, f"request body not received within {BODY_TIMEOUT_S:.0f} s"
        ) from None
    except ClientDisconnect:
        # The caller (the router) gave up before sending the whole body: nobody reads the answer.
        raise RequestError(499, "client disconnected before the request body was read") from None
    return b"".join(chunks)


async def read_json(request: Request) -> dict[str, Any]:
    raw = await read_body(request)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    return body


def add_generate(app: FastAPI, front: NodeFront, check_internal: Callable) -> None:
    """POST /generate: the whole answer, or an SSE stream of chunks when `stream` is set."""

    @app.post("/generate")
    async def generate(request: Request):
        check_internal(request)
        body = await read_json(request)
        sp = body.get("sampling_params")
        if isinstance(sp, dict) and sp.get("guide") is not None:
            await front.guide_gate.check(sp["guide"])  # compiles in time, or a 400 now
        ids = None
        if (
            not front.dead and len(front.pending) < front.max_pending
        ):  # else admit() says why, untokenised
            ids = await asyncio.get_running_loop().run_in_executor(
                TOKENIZER_POOL, front.tokenize, body
            )
        p = front.admit(body, ids, request.headers.get("traceparent"))
        # log lines of this request carry its rid and trace id (JSON format)
        bind_request(p.rid, front.tracing.trace_id(p.rid))
        answer = await front.answer(p)
        if answer is not None:
            return answer
        if body.get("stream"):

            async def stream():
                async for chunk in front.events(p):
                    yield sse(chunk)
                yield sse("[DONE]")

            return StreamingResponse(stream(), media_type="text/event-stream")
        text, last = [], None
        async for chunk in front.events(p):
            text.append(chunk["text"])
            last = chunk
        assert last is not None  # events() always ends with a finish or an error chunk
        if "error" in last:
            status = 400 if last["error"]["param"] else 503
            return JSONResponse({"error": last["error"]}, status_code=status)
        meta = dict(last["meta_info"])
        if p.params.logprobs:
            meta["logprobs"] = p.logprobs
        return {"rid": p.rid, "text": "".join(text), "token_ids": p.token_ids, "meta_info": meta}


def add_tokenize(app: FastAPI, front: NodeFront, check_internal: Callable) -> None:
    """POST /tokenize and /detokenize (vLLM's shapes), in the tokenizer thread pool."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        check_internal(request)
        body = await read_json(request)
        return await asyncio.get_running_loop().run_in_executor(
            TOKENIZER_POOL, node_tokenize.tokenize, front, body
        )

    @app.post("/detokenize")
    async def detokenize(request: Request):
        check_internal(request)
        body = await read_json(request)
        return await asyncio.get_running_loop().run_in_executor(
            TOKENIZER_POOL, node_tokenize.detokenize, front, body
        )


def add_abort(app: FastAPI, front: NodeFront, check_internal: Callable) -> None:
    """POST /abort: ends the request `rid` if this node holds it."""

    @app.post("/abort")
    async def abort(request: Request):
        check_internal(request)
        body = await read_json(request)
        rid = body.get("rid")
        if not isinstance(rid, str) or not rid or len(rid) > RID_MAX:
            raise RequestError(
                400, f"'rid' (a string of 1 to {RID_MAX} characters) is required", "rid"
            )
        return {"aborted": front.abort(rid)}


def add_status(app: FastAPI, front: NodeFront, check_internal: Callable) -> None:
    """GET /health (open) and /server_info."""

    @app.get("/health")
    async def health():
        ok, why = front.healthy()
        # dead: a rank exited and the node will not recover (a restart is needed); otherwise an
        # unhealthy node is still starting or its ranks' stats are late. draining: healthy, but
        # choose it no more (runtime/front/drain.py)
        status = "unhealthy" if not ok else "draining" if front.draining else "ok"
        return JSONResponse(
            {"status": status, "detail": why, "dead": bool(front.dead), "draining": front.draining},
            status_code=200 if ok else 503,
        )

    @app.post("/drain")
    async def drain(request: Request):
        """Stops the node gracefully (runtime/front/drain.py); optional body {"grace_s": n}."""
        check_internal(request)
        body = await read_json(request) if int(request.headers.get("content-length") or 0) else {}
        grace = body.get("grace_s")
        if grace is not None and (
            not isinstance(grace, (int, float)) or isinstance(grace, bool) or not 0 <= grace <= 3600
        ):
            raise RequestError(400, "'grace_s' must be a number of seconds in [0, 3600]", "grace_s")
        drainer = getattr(request.app.state, "drain", None)
        if drainer is None:
            raise RequestError(503, "this node cannot drain yet: it is starting")
        return drainer.start(grace)

    @app.get("/server_info")
    async def server_info(request: Request):
        check_internal(request)
        return front.server_info()


def add_observability(app: FastAPI, front: NodeFront, check_internal: Callable) -> None:
    """GET /debug/spans/{rid} and /metrics (open)."""

    @app.get("/debug/spans/{rid}")
    async def debug_spans(rid: str, request: Request):
        """A traced request's spans on this node (the router's timeline, docs/TRACING.md)."""
        check_internal(request)
        spans = front.tracing.spans(rid)
        if spans is None:
            raise RequestError(404, f"no traced request {rid[:RID_MAX]!r} is kept here", "rid")
        return {"rid": rid, "role": front.role, "spans": spans}

    @app.get("/metrics")
    async def metrics():
        if front.metrics is None:
            return Response("", media_type="text/plain")
        body, ctype = front.metrics.render(front)
        return Response(body, media_type=ctype)


def build_app(front: NodeFront, internal_token: str | None = None) -> FastAPI:
    app = FastAPI(title=f"pdserve {front.role} node", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestError)
    async def _req_error(_: Request, e: RequestError):
        headers = {"Retry-After": "1"} if e.code == OVERLOADED else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    # internal calls are signed with the cluster secret, which never crosses the network
    app.add_middleware(
        SignatureCheck, secret=internal_token, max_body=MAX_BODY, body_timeout_s=BODY_TIMEOUT_S
    )

    def check_internal(request: Request) -> None:
        if not is_signed(request, internal_token):
            raise RequestError(401, "internal endpoint: the request must be signed")

    add_generate(app, front, check_internal)
    add_abort(app, front, check_internal)
    add_tokenize(app, front, check_internal)
    add_status(app, front, check_internal)
    front.add_routes(app, check_internal)
    add_observability(app, front, check_internal)

    @app.on_event("startup")
    async def _start():
        front.start()

    @app.on_event("shutdown")
    async def _stop():
        await front.close()

    return app
