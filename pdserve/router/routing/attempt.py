"""One try of one request on one (prefill, decode) pair (its failures are described in failures.py).

An `Attempt` has its own rid and bootstrap room. It is "open" once the decode node produced its
first stream event (or, not streaming, its whole answer) and the prefill node did not fail first.
Until then a failure is a `Failure` the dispatcher may retry on a new pair; after it nothing is
retried, because the client may already have bytes.

Contract of an open attempt: the caller reads `events()` (streaming) or `result` and then calls
`close(ok)` exactly once; `close` never awaits (it may run inside a cancelled task), it settles the
workers' load and breakers and leaves aborts and socket closing to background tasks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

from pdserve.router.admission import ADMITTED, Ticket
from pdserve.router.openai_api.responses import NodeAborted, check_event, parse_sse_line
from pdserve.router.routing.failures import Failure, aborted, node_failure, unreachable
from pdserve.router.routing.timing import Timing
from pdserve.router.routing.worker import Worker
from pdserve.router.timeline import CURRENT

if TYPE_CHECKING:
    from pdserve.router.routing.dispatch import Dispatcher

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")

PREFILL_GRACE_S = 5.0  # after decode finished, how long a still-open prefill call may take
HEALTH_POLL_S = 0.5  # how often an attempt awaiting its first token looks at its nodes' health


@dataclass
class Route:
    prefill: Worker | None  # None: colocated worker or decode-only, no PD split
    decode: Worker
    prompt_tokens: int = 0  # estimated tokens to prefill, charged to the worker that prefills
    key_chars: int = 0  # the prompt key's length, to learn characters per token (0: ids prompt)
    path: str = "colocated"  # "disaggregated" | "decode_only" | "colocated"
    predicted_ttft_s: float | None = None  # the latency model's (latency_model.py)
    reason: str = ""  # why this path (router/routing/disagg.py), for the trace


def node_share(ticket: Ticket | None) -> dict:
    """The fields that place the request in a node's fair queue (engine/fair_queue.py): always
    set, so that nothing a client put in its body under these names reaches a node."""
    if ticket is None:  # admitted without a ticket (in-process callers, tests)
        return {"tenant": "", "tenant_weight": 1.0, "priority": 0}
    return {"tenant": ticket.tenant, "tenant_weight": ticket.weight, "priority": ticket.priority}


class Attempt:
    def __init__(self, dispatcher: Dispatcher, route: Route, body: dict, stream: bool):
        self.d, self.route, self.stream = dispatcher, route, stream
        self.rid = uuid.uuid4().hex
        self.tenant: str = (share := node_share(ADMITTED.get()))["tenant"]
        self.payload = {**body, "rid": self.rid, "stream": stream, **share}
        if route.prefill is not None:
            self.payload.update(
                bootstrap_host=route.prefill.bootstrap_host,
                bootstrap_port=route.prefill.bootstrap_port,
                bootstrap_room=secrets.randbits(63),
            )
        self.prefill_task: asyncio.Task | None = None
        self.response: httpx.Response | None = None
        self._lines: AsyncIterator[str] | None = None
        self.first: dict | None = None  # streaming: the first decode event
        self.result: dict | None = None  # not streaming: the decode answer
        self.prefill_meta: dict | None = None  # the prefill node's meta_info, once it answered
        self.last_meta: dict = {}  # streaming: the decode node's final meta_info
        self.closed = False
        self.trace = CURRENT.get()  # the request's trace (router/timeline.py); None: tracing off
        self.headers = dispatcher.node_headers
        # the worker whose prefill queue this attempt's prompt is charged to, until it is prefilled
        self._charged: Worker | None = route.prefill or route.decode
        self.timing = Timing()  # what the latency model learns from (latency_model.py)

    def _prefilled(self) -> None:
        """The prompt left its prefill queue (or the attempt ended): uncharge it, once."""
        if self._charged is not None:
            self.d.disagg.model.closed(self._charged.url, id(self))
            self._charged.queue(self.tenant, -self.route.prompt_tokens, -1)
            self._charged = None
            self.d.on_prefilled()

    async def start(self) -> None:
        route, cfg = self.route, self.d.cfg
        self.timing.sent(route, self.tenant)
        charged, n, model, t = self._charged, route.prompt_tokens, self.d.disagg.model, self.tenant
        if charged is not None:
            model.opened(charged.url, id(self), model.fit_prefill_s(charged, n, t), t)
            charged.queue(t, n, 1)
        ticket = ADMITTED.get()
        if ticket is not None:
            ticket.charged()
        if self.trace is not None:
            nodes = [(w.role, w.url) for w in (route.prefill, route.decode) if w is not None]
            traceparent = self.trace.attempt_start(self.rid, nodes, route)
            self.headers = {**self.d.node_headers, "traceparent": traceparent}
        for w in (route.prefill, route.decode):
            if w is not None:
                w.in_flight += 1
                w.breaker.on_dispatch()
        if route.prefill is not None:
            self.prefill_task = asyncio.create_task(self._prefill(route.prefill))
            self.prefill_task.add_done_callback(_retrieve)
        decode_task = asyncio.create_task(self._decode())
        decode_task.add_done_callback(_retrieve)
        try:
            async with asyncio.timeout(cfg.request_timeout_s):
                waiting = {t for t in (decode_task, self.prefill_task) if t is not None}
                while not decode_task.done():
                    done, waiting = await asyncio.wait(
                        waiting, timeout=HEALTH_POLL_S, return_when=asyncio.FIRST_COMPLETED
                    )
                    if self.prefill_task in done:
                        self.prefill_task.result()  # raises the prefill's Failure
                    self._check_health()
            decode_task.result()
        except TimeoutError:
            p = self.prefill_task
            culprit = route.prefill if p is not None and not p.done() else route.decode
            failure = Failure(
                504,
                f"no answer from {culprit.role} node {culprit.url} within "
                f"{cfg.request_timeout_s:g} s",
                code="upstream_timeout",
                retryable=True,
                culprit=culprit,
                node_fault=True,
            )
            self._give_up(decode_task, failure)
            raise failure from None
        except Failure as failure:
            self._give_up(decode_task, failure)
            raise
        except BaseException:  # cancelled: the client went away
            decode_task.cancel()
            self.close(None, abort=True)
            raise

    def _check_health(self) -> None:
        """A node of this attempt that turned unhealthy while its answer is awaited (a stalled
        rank: its node's /health fails once the rank's stats are late) ends the attempt now, to be
        retried elsewhere, not at --request-timeout."""
        legs = [self.route.decode]
        if self.prefill_task is not None and not self.prefill_task.done():
            legs.append(self.route.prefill)
        for w in legs:
            if w is not None and not w.healthy:
                raise Failure(
                    502,
                    f"{w.role} node {w.url} turned unhealthy before the first token",
                    code=f"{w.role}_failed",
                    retryable=True,
                    culprit=w,
                    node_fault=True,
                )

    def _give_up(self, decode_task: asyncio.Task, failure: Failure) -> None:
        decode_task.cancel()
        blame = failure.culprit is self.route.decode and failure.node_fault
        self.close(False if blame else None, abort=True)

    async def _prefill(self, worker: Worker) -> None:
        verdict = None
        try:
            client = self.d.clients.get(worker.url)
            resp = await client.post(
                f"{worker.url}/generate",
                json={**self.payload, "pd_side": "prefill"},
                headers=self.headers,
            )
            if resp.status_code != 200:
                failure = node_failure(worker, resp, resp.content)
                verdict = False if failure.node_fault else None
                raise failure
            answer = resp.json()
            check_event(answer)
            self.prefill_meta = answer.get("meta_info") or {}
            verdict = True
            self.timing.prefilled(self.d, self.route)
        except httpx.HTTPError as exc:
            verdict = False
            raise unreachable(worker, exc) from None
        except NodeAborted as exc:
            raise aborted(worker, exc) from None
        except ValueError as exc:
            verdict = False
            raise unreachable(worker, exc) from None
        finally:
            self._prefilled()
            worker.in_flight -= 1
            worker.breaker.record(verdict)
            self.d.registry.report(worker)

    async def _decode(self) -> None:
        worker = self.route.decode
        try:
            client = self.d.clients.get(worker.url)
            # which end of a PD pair this node is: an elastic node serving prefill refuses the
            # decode end (elastic_node/front.py), whatever the bootstrap address it names
            payload = (
                self.payload
                if self.route.prefill is None
                else {**self.payload, "pd_side": "decode"}
            )
            request = client.build_request(
                "POST", f"{worker.url}/generate", json=payload, headers=self.headers
            )
            self.response = await client.send(request, stream=True)
            if self.response.status_code != 200:
                raise node_failure(worker, self.response, await self.response.aread())
            if self.stream:
                self._lines = self.response.aiter_lines()
                first = await self._next_event()
                if first is None:
                    raise NodeAborted("the stream ended before any data")
                check_event(first)
                self.first = first
                self.timing.first_token(self.d, self.route)
                if self.trace is not None:
                    self.trace.first_token(self.rid)
            else:
                self.result = json.loads(await self.response.aread())
                if not isinstance(self.result, dict):
                    raise ValueError("the answer is not a JSON object")
                check_event(self.result)
        except (httpx.HTTPError, ValueError) as exc:
            raise unreachable(worker, exc) from None
        except NodeAborted as exc:
            raise aborted(worker, exc) from None
        except BaseException:
            if self.response is not None:  # cancelled: close() may have run already
                self.d.spawn(self.response.aclose())
            raise
        finally:
            if self.route.prefill is None:  # decode-only: its first event ends its prefill
                self._prefilled()

    async def _next_event(self) -> dict | None:
        """The next data event of the decode stream; None at `[DONE]` or end of stream."""
        assert self._lines is not None
        async for line in self._lines:
            event = parse_sse_line(line)
            if event == "[DONE]":
                return None
            if event is not None:
                return event
        return None

    async def events(self) -> AsyncIterator[dict]:
        """The decode stream's events from the first on (raises NodeAborted, httpx errors,
        TimeoutError when the node is silent for `stream_idle_timeout_s`)."""
        assert self.first is not None
        event: dict | None = self.first
        while event is not None:
            yield event
            meta = event.get("meta_info") or {}
            if meta.get("finish_reason") is not None:
                self.last_meta = meta
                return
            async with asyncio.timeout(self.d.cfg.stream_idle_timeout_s):
                event = await self._next_event()
            self.timing.token()
        raise NodeAborted("the decode node ended the stream without a finish_reason")

    async def cached_tokens(self) -> int | None:
        """Prompt tokens the prefix cache held: the prefill node's count on a PD pair (waiting up to
        PREFILL_GRACE_S for its answer, which may come after the decode node's last token), the
        colocated node's from its finish meta. None when unknown."""
        if self.prefill_task is None:
            meta = (self.result or {}).get("meta_info") or self.last_meta
        else:
            await asyncio.wait({self.prefill_task}, timeout=PREFILL_GRACE_S)
            meta = self.prefill_meta or {}
        value = meta.get("cached_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def close(self, ok: bool | None, abort: bool = False) -> None:
        """Settle this attempt (see module docstring). `abort` tells both nodes to drop the rid."""
        if self.closed:
            return
        self.closed = True
        self._prefilled()
        meta = self.prefill_meta or (self.result or {}).get("meta_info") or self.last_meta
        self.d.disagg.tokens.learn(self.route.key_chars, meta.get("prompt_tokens"))
        self.timing.ended(self.d, self.route)
        if self.trace is not None:
            self.trace.attempt_end(self.rid, ok, self._finish_type())
        decode = self.route.decode
        decode.in_flight -= 1
        decode.breaker.record(ok)
        self.d.registry.report(decode)
        if self.response is not None:
            self.d.spawn(self.response.aclose())
        prefill, task = self.route.prefill, self.prefill_task
        if abort:
            for w in (prefill, decode):
                if w is not None:
                    self.d.spawn(self.d.abort(w, self.rid))
        elif prefill is not None and task is not None and not task.done():
            self.d.spawn(_reap_prefill(self.d, prefill, task, self.rid))
        if abort and task is not None and not task.done():
            task.cancel()

    def _finish_type(self) -> str | None:
        meta = self.last_meta or (self.result or {}).get("meta_info") or {}
        reason = meta.get("finish_reason") if isinstance(meta, dict) else None
        return reason.get("type") if isinstance(reason, dict) else None


async def _reap_prefill(d: Dispatcher, worker: Worker, task: asyncio.Task, rid: str) -> None:
    """Decode finished while the prefill call is still open: wait a little, then abort it."""
    done, _ = await asyncio.wait({task}, timeout=PREFILL_GRACE_S)
    if not done:
        logger.warning(
            "rid=%s prefill node %s still busy after decode finished; aborting",
            rid,
            worker.url,
            extra={"rid": rid},
        )
        task.cancel()
        await d.abort(worker, rid)


def _retrieve(task: asyncio.Task) -> None:
    """Mark a finished task's exception as seen (it is re-raised where it matters)."""
    if not task.cancelled():
        task.exception()
