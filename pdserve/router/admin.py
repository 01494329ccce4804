"""The operator endpoints: the worker list (GET/POST/DELETE /workers, internal token), /v1/models
and /openapi.json (API key). Each is `handler(router, request, t0)`, run by `Router.serve`."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.config import WorkerSpec
from pdserve.router.errors import ApiError
from pdserve.router.openai_api.openapi import openapi_document
from pdserve.router.state import Router


async def add_worker(router: Router, request: Request, t0: float) -> Response:
    router.check_internal(request)
    body = await router.read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        raise ApiError(
            400,
            'send {"url": ..., "role": prefill|decode|colocated, "bootstrap_port": optional int}',
            param="url",
        )
    try:
        spec = WorkerSpec(
            url=body["url"],
            role=body.get("role", "decode"),
            bootstrap_port=body.get("bootstrap_port"),
        )
        worker = router.registry.add(spec)
        router.dispatcher.pairs.track(router.registry.all())
    except (ValueError, TypeError) as exc:
        status = 409 if "already registered" in str(exc) else 400
        raise ApiError(status, str(exc), param="url") from None
    await router.registry.probe(worker)
    return JSONResponse({"worker": worker.describe()})


async def remove_worker(router, request: Request, t0: float) -> Response:
    router.check_internal(request)
    url = request.query_params.get("url")
    if not url:
        raise ApiError(400, "give the worker as DELETE /workers?url=...", param="url")
    try:
        worker = router.registry.remove(url)
        router.dispatcher.pairs.forget(url)
        router.dispatcher.disagg.model.forget(url)  # a node added back later is measured anew
    except KeyError:
        raise ApiError(404, f"no worker {url} is registered", param="url") from None
    return JSONResponse({"removed": worker.describe()})


async def list_workers(router: Router, request: Request, t0: float) -> Response:
    router.check_internal(request)
    return JSONResponse(
        {
            "workers": [w.describe() for w in router.registry.all()],
            "pairs": router.dispatcher.pairs.describe(),  # router/routing/pair_health.py
        }
    )


async def models(router: Router, request: Request, t0: float) -> Response:
    router.check_api_key(request)
    data = [
        {
            "id": m,
            "object": "model",
            "created": 0,
            "owned_by": "pdserve",
            "max_model_len": router.registry.max_context(m),
        }
        for m in router.registry.models()
    ]
    return JSONResponse({"object": "list", "data": data})


async def openapi(router: Router, request: Request, t0: float) -> Response:
    router.check_api_key(request)
    return JSONResponse(
        openapi_document(
            router.registry.models(),
            router.registry.max_context(),
            auth=router.tenants.required,
            tools=any(w.tool_format for w in router.registry.all()),
        )
    )
