"""OpenAI's `n` > 1 (and vLLM's `best_of` = n): one node request per choice, merged into one answer.

The prompt is computed once. Choice 0 goes first; once its first token arrived, its prompt's KV is
complete and its whole pages are in that node's prefix cache (engine/scheduler.py
`_cache_prompt`), and choices 1..n-1 go at once to the same pair (`Dispatcher.open(follow=...)`),
where each is admitted with the prompt's whole pages shared and prefills only the last partial page.
docs/ROUTER.md has the measurements and why the router, not the node, orders them.

Seeds: choice i samples with `seed + i` (mod 2^63), so a seeded request is reproducible and its
choices differ; without a seed each choice draws from the node's generator, independently.

Every choice is streamed from its node (the first token is what lets the others go); a client that
did not ask for a stream gets the choices collected into one answer. Usage counts the prompt once
and sums the completions, as OpenAI does; `cached_tokens` is choice 0's (the one prompt
computation). One client request holds one admission slot, whatever its `n`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.admission import Ticket
from pdserve.router.errors import ApiError
from pdserve.router.openai_api.owned_stream import OwnedStream, abandon
from pdserve.router.openai_api.responses import (
    NodeAborted,
    Shape,
    StreamShaper,
    answer_choice,
    check_event,
    completion,
)
from pdserve.router.openai_api.streams import CLIENT_CLOSED, StreamClock
from pdserve.router.routing.attempt import PREFILL_GRACE_S, Attempt
from pdserve.router.state import wait_disconnect

if TYPE_CHECKING:
    from pdserve.router.state import Router


def choice_body(native: dict[str, Any], i: int) -> dict[str, Any]:
    """Choice i's native body: the same prompt and parameters, the seed + i when seeded."""
    seed = native["sampling_params"].get("seed")
    if i == 0 or seed is None:
        return native
    return {**native, "sampling_params": {**native["sampling_params"], "seed": (seed + i) % 2**63}}


async def serve(
    router: Router,
    request: Request,
    t0: float,
    native: dict[str, Any],
    key: str,
    model: str,
    n: int,
    stream: bool,
    shape: Callable[[str], Shape],
    route: str,
    tenant: str,
    priority: int = 0,
) -> Response:
    # n node requests: n units of admission
    ticket = await router.admit(tenant, native, key, model, n, priority)
    handed_over = False
    try:
        attempts = await open_choices(router, request, native, key, model, n)
        s = shape(attempts[0].rid)
        if stream:
            handed_over = True
            return OwnedStream(
                stream_choices(router, attempts, s, route, t0, ticket),
                abandon(router, route, t0, ticket, attempts),
                headers={"Cache-Control": "no-cache"},
            )
        answer, longest = await whole_answer(router, request, attempts, s)
        # the choices ran at once: the whole answer took as long as its longest one
        router.slo.finished_whole(time.perf_counter() - t0, longest)
        return JSONResponse(answer)
    finally:
        if not handed_over:
            ticket.release()


async def open_choices(
    router: Router, request: Request, native: dict, key: str, model: str, n: int
) -> list[Attempt]:
    """Choice 0, then, once its first token arrived, choices 1..n-1 on its pair. Every attempt
    is open (streaming) on return; on any failure none is left open."""
    first = await router.open_watched(request, native, key, True, model, keepalive=False)
    assert not isinstance(first, asyncio.Task)  # keepalive=False: open or failed
    d = router.dispatcher
    tasks = [
        asyncio.create_task(d.open(choice_body(native, i), key, True, model, first.route))
        for i in range(1, n)
    ]
    watcher = asyncio.create_task(wait_disconnect(request))
    error: BaseException | None = None
    try:
        pending = set(tasks)
        while pending and error is None:
            done, _ = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
            pending -= done
            if watcher in done:
                error = ApiError(499, "client closed the request", code="client_closed")
            error = error or next((t.exception() for t in done if t.exception()), None)
    finally:
        watcher.cancel()
        if error is not None or pending:  # pending here: this coroutine was cancelled
            for t in tasks:
                t.cancel()
            await asyncio.wait(tasks)  # a cancelled dispatch closes and aborts what it opened
            for a in [first, *(t.result() for t in tasks if _opened(t))]:
                a.close(None, abort=True)
    if error is not None:
        raise error
    return [first, *(t.result() for t in tasks)]


def _opened(task: asyncio.Task) -> bool:
    return not task.cancelled() and task.exception() is None


async def _collect(attempt: Attempt) -> dict[str, Any]:
    """A choice's stream as one native answer: the text joined, the last meta_info with every
    chunk's logprobs."""
    text, logprobs, meta = [], [], {}
    async for event in attempt.events():
        check_event(event)
        text.append(event.get("text") or "")
        meta = event.get("meta_info") or {}
        logprobs.extend(meta.get("logprobs") or ())
    return {"text": "".join(text), "meta_info": {**meta, "logprobs": logprobs}}


def _summed(metas: list[dict]) -> dict[str, int]:
    return {
        "prompt_tokens": int(metas[0].get("prompt_tokens") or 0),
        "completion_tokens": sum(int(m.get("completion_tokens") or 0) for m in metas),
    }


async def whole_answer(
    router: Router, request: Request, attempts: list[Attempt], shape: Shape
) -> tuple[dict[str, Any], int]:
    """Every choice collected into one chat.completion / text_completion; and the completion
    tokens of the longest choice."""
    gather = asyncio.gather(*(_collect(a) for a in attempts))
    watcher = asyncio.create_task(wait_disconnect(request))
    ok: bool | None = None
    try:
        timeout = router.cfg.request_timeout_s
        done, _ = await asyncio.wait(
            {gather, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if gather not in done:
            gather.cancel()
            if watcher in done:
                raise ApiError(499, "client closed the request", code="client_closed")
            raise ApiError(504, f"no whole answer within {timeout:g} s", type="server_error")
        try:
            natives = gather.result()
        except NodeAborted as exc:
            raise _failed(attempts[0], exc.message, "node_aborted") from None
        except (httpx.HTTPError, TimeoutError) as exc:
            ok = False
            raise _failed(attempts[0], f"{type(exc).__name__} {exc}", "decode_failed") from None
        cached = await attempts[0].cached_tokens()
        ok = True
    finally:
        watcher.cancel()
        for a in attempts:
            a.close(ok, abort=ok is not True)
    choices = [answer_choice(shape, native, i) for i, native in enumerate(natives)]
    total = {"meta_info": _summed([x["meta_info"] for x in natives])}
    longest = max(int(x["meta_info"].get("completion_tokens") or 0) for x in natives)
    return completion(shape, total, cached, choices), longest


def _failed(attempt: Attempt, message: str, code: str) -> ApiError:
    url = attempt.route.decode.url
    return ApiError(502, f"decode node {url}: {message}", type="server_error", code=code)


async def stream_choices(
    router: Router,
    attempts: list[Attempt],
    shape: Shape,
    route: str,
    t0: float,
    ticket: Ticket,
) -> AsyncIterator[bytes]:
    """The choices' SSE chunks as they come, each with its `index`; then usage and [DONE]. Owns
    the attempts and their n units of admission (as router/openai_api/streams.py's generators
    own their one)."""
    shapers = [StreamShaper(shape, i) for i in range(len(attempts))]
    clocks = [StreamClock(t0) for _ in attempts]  # goodput: each choice's own gaps
    queue: asyncio.Queue = asyncio.Queue()
    pumps = [asyncio.create_task(_pump(i, a, shapers[i], queue)) for i, a in enumerate(attempts)]
    status, left, cached = 200, len(attempts), None
    try:
        first_token_s = time.perf_counter() - t0  # choice 0's first token is in
        router.metrics.observe_ttft(first_token_s)
        while left:
            try:
                async with asyncio.timeout(router.cfg.stream_idle_timeout_s + PREFILL_GRACE_S):
                    i, item = await queue.get()
            except TimeoutError as exc:  # a pump died without a word
                i, item = -1, exc
            if isinstance(item, list):
                if item:
                    clocks[i].event()
                for chunk in item:
                    yield chunk
                continue
            if item is None:  # choice i ended
                left -= 1
                if i == 0:
                    cached = await attempts[0].cached_tokens()
                attempts[i].close(True)
                continue
            status = 502
            code = "node_aborted" if isinstance(item, NodeAborted) else "decode_failed"
            message = item.message if isinstance(item, NodeAborted) else repr(item)
            for a in attempts:
                a.close(None if code == "node_aborted" else False, abort=True)
            for chunk in StreamShaper.error(f"choice {i}: {message}", code=code):
                yield chunk
            return
        shapers[0].meta = _summed([s.meta for s in shapers])
        # goodput: choice 0's first token (the stream started on it), and the slowest choice's gaps
        gaps = [g for g in (c.itl_s() for c in clocks) if g is not None]
        router.slo.finished(first_token_s, max(gaps, default=None))
        for chunk in shapers[0].tail(cached):
            yield chunk
    finally:
        for p in pumps:
            p.cancel()
        for a in attempts:
            if not a.closed:
                status = CLIENT_CLOSED
                a.close(None, abort=True)
        ticket.release()  # the request's n units
        router.metrics.observe_request(route, status, time.perf_counter() - t0)


async def _pump(i: int, attempt: Attempt, shaper: StreamShaper, queue: asyncio.Queue) -> None:
    """Choice i's SSE chunks into `queue` as (i, chunks); then (i, None), or (i, the error)."""
    try:
        async for event in attempt.events():
            queue.put_nowait((i, shaper.chunks(event)))
        queue.put_nowait((i, None))
    except (NodeAborted, httpx.HTTPError, TimeoutError) as exc:
        queue.put_nowait((i, exc))
