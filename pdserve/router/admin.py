"""The operator endpoints: the worker list (GET/POST/DELETE /workers, internal token), /v1/models
and /openapi.json (API key). Each is `handler(router, request, t0)`, run by `Router.serve`."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.errors import ApiError
from pdserve.router.openai_api.openapi import openapi_document
from pdserve.router.state import Router
from pdserve.router.worker_spec import WorkerSpec, WorkerSpecError


async def add_worker(router: Router, request: Request, t0: float) -> Response:
    router.check_internal(request)
    body = await router.read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        raise ApiError(
            400,
            'send {"url": ..., "role": prefill|decode|colocated, "bootstrap_port": optional int, '
            '"replica": optional int}',
            param="url",
        )
    try:
        spec = WorkerSpec(
            url=body["url"],
            role=body.get("role", "decode"),
            bootstrap_port=body.get("bootstrap_port"),
            replica=body.get("replica"),
        )
        worker = router.registry.add(spec)
        router.dispatcher.pairs.track(router.registry.all())
    except WorkerSpecError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
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


ROLE_CHANGE_TIMEOUT_S = 600.0  # default bound of a role change; its drain waits for streams


async def change_role(router: Router, request: Request, t0: float) -> Response:
    """POST /workers/role {"url", "role", "timeout_s", "grace_s"}: an elastic worker changes role
    (its requests finish first; with `grace_s`, those left when it has passed move on to other
    nodes, streams mid-stream); answered once it serves the new role."""
    router.check_internal(request)
    body = await router.read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("url"), str):
        raise ApiError(400, 'send {"url": ..., "role": prefill|decode}', param="url")
    role = body.get("role")
    if role not in ("prefill", "decode"):
        raise ApiError(400, "'role' must be prefill or decode", param="role")
    timeout_s = body.get("timeout_s", ROLE_CHANGE_TIMEOUT_S)
    if (
        not isinstance(timeout_s, (int, float))
        or isinstance(timeout_s, bool)
        or not 1 <= timeout_s <= 3600
    ):
        raise ApiError(400, "'timeout_s' must be seconds in [1, 3600]", param="timeout_s")
    grace_s = body.get("grace_s")
    if grace_s is not None and (
        not isinstance(grace_s, (int, float))
        or isinstance(grace_s, bool)
        or not 0 <= grace_s <= 3600
    ):
        raise ApiError(400, "'grace_s' must be seconds in [0, 3600]", param="grace_s")
    worker = router.registry.get(body["url"])
    if worker is None:
        raise ApiError(404, f"no worker {body['url']} is registered", param="url")
    if not worker.elastic:
        raise ApiError(409, f"{worker.url} is not an elastic node (--elastic)", param="url")
    if worker.role == role and worker.changing_to is None:
        return JSONResponse({"worker": worker.describe()})  # nothing to do
    if worker.role == "decode" and not [
        w for w in router.registry.serving(worker.model, "decode") if w is not worker
    ]:
        # prefill without decode serves nothing; decode alone prefills its own prompts
        raise ApiError(409, f"{worker.url} is the last decode node of its model", param="url")
    try:
        grace = None if grace_s is None else float(grace_s)
        await router.registry.change_role(worker, role, float(timeout_s), grace)
    except (RuntimeError, TimeoutError) as exc:
        raise ApiError(409 if isinstance(exc, RuntimeError) else 504, str(exc)) from None
    finally:
        router.dispatcher.pairs.track(router.registry.all())
    return JSONResponse({"worker": worker.describe()})


async def list_workers(router: Router, request: Request, t0: float) -> Response:
    router.check_internal(request)
    return JSONResponse(
        {
            "workers": [w.describe() for w in router.registry.all()],
            "pairs": router.dispatcher.pairs.describe(),  # router/routing/pair_health.py
            # the elastic controller's targets, last look and moves (router/routing/elastic.py)
            "elastic": router.elastic.describe() if router.elastic is not None else None,
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
