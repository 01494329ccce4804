"""Mid-stream migration: a stream whose decode node dies, stalls or fails it continues on another
decode node, and the client sees one stream, token for token.

The router keeps, for each open stream, the token ids the client has and how many characters of
their text it got. When the stream breaks, the router opens a new attempt on another decode node
with the same body plus `resume` ({"token_ids", "text_chars"}). That node, or a prefill node that
moves the KV to it, whichever the router predicts is faster (router/routing/disagg.py, on the
prompt and the tokens sent), prefills the prompt and those tokens, counts them as output, and
generates from the next position. The continuation is the one the first node would have produced:
- greedy decoding is a function of the tokens alone;
- a seeded request draws from a generator seeded by (seed, position) (engine/sampling.py);
- penalties, `logit_bias`, `max_tokens` and stop strings read the output tokens, the resumed ones
  included (engine/scheduler.py);
- a grammar's matcher is fed the output tokens from the first (engine/grammar.py), so structured
  output and forced tool calls go on in the same state;
- the new node's detokenizer starts where the client's text ends (IncrementalDetokenizer.resume).
An unseeded sampled request continues with fresh draws: correct, but not the sequence the first
node would have drawn. In bf16 the continuation is exact where the nodes serve batch-invariantly
(`--batch-invariant`): otherwise the replay's prefill rounds the tokens' KV differently from the
decode steps that made them, and a later near-tie can go the other way.

What breaks a stream, and is migrated (the `cause` label):
- `connection`: the HTTP stream to the node failed (its front died, the link broke);
- `stream_cut`: the node ended the stream without a finish;
- `node_unhealthy`: the worker's health probes failed while the stream waited (a stalled rank);
- `idle_timeout`: no event for --stream-idle-timeout;
- the node's own abort for a node fault: `node_failure` (a rank exited), `kv_transfer_failed`,
  `bootstrap_failed`; or `node_draining`: the node drains (runtime/front/drain.py) and its grace
  period ended.
A client's error, a node's request timeout and the client going away are not migrated.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from pdserve.router.errors import ApiError
from pdserve.router.openai_api.responses import NodeAborted
from pdserve.router.routing.attempt import HEALTH_POLL_S, Attempt, Route

if TYPE_CHECKING:
    from pdserve.router.routing.dispatch import Dispatcher

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")

# a node's abort codes (runtime/reasons.py) that say the node failed, not the request
MIGRATED_ABORTS = frozenset(
    {"node_failure", "node_draining", "kv_transfer_failed", "bootstrap_failed"}
)
_END = object()


class StreamBroken(Exception):
    def __init__(self, cause: str, error: BaseException):
        super().__init__(cause)
        self.cause, self.error = cause, error


def _node_abort(event: dict) -> str | None:
    """The abort code of an event that ends the request for a node fault; else None."""
    error = event.get("error")
    if isinstance(error, dict) and error.get("code") in MIGRATED_ABORTS:
        return error["code"]
    reason = (event.get("meta_info") or {}).get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        code = reason.get("code")
        return code if code in MIGRATED_ABORTS else None
    return None


class ResumableStream:
    """An open streaming attempt that moves to another decode node when its own breaks. It has the
    interface of `Attempt` that the stream generators use (events, close, closed, cached_tokens,
    route, rid); the client's id stays the first attempt's rid."""

    def __init__(
        self, d: Dispatcher, attempt: Attempt, body: dict, key: str, model: str | None
    ) -> None:
        self.d, self.attempt = d, attempt
        self.body, self.key, self.model = body, key, model
        self.rid = attempt.rid
        self.token_ids: list[int] = []  # what the client has, in order
        self.text_chars = 0  # characters of text the client has
        self.migrations = 0
        self._first_cached: int | None = None  # the first attempt's prefix-cache hit
        self._pump: asyncio.Task | None = None
        self._closed = False  # close() ran: nothing moves any more

    # --- the Attempt interface ------------------------------------------------------------
    @property
    def route(self) -> Route:
        return self.attempt.route

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def result(self) -> dict | None:
        return self.attempt.result

    def close(self, ok: bool | None, abort: bool = False) -> None:
        self._closed = True
        if self._pump is not None:
            self._pump.cancel()
        self.attempt.close(ok, abort)

    async def cached_tokens(self) -> int | None:
        """The prompt tokens the first node's prefix cache held (a replay's are not the client's
        prompt); None when a migration left it unknown."""
        if self.migrations == 0:
            return await self.attempt.cached_tokens()
        return self._first_cached

    # --- the stream -----------------------------------------------------------------------
    async def events(self) -> AsyncIterator[dict]:
        """The events of the stream, across migrations (raises as Attempt.events does when the
        stream breaks for a cause that is not migrated, or no new attempt opens)."""
        t_last = time.monotonic()
        while True:
            try:
                async for event in self._events_of(self.attempt):
                    self._record(event)
                    yield event
                    t_last = time.monotonic()
                return
            except StreamBroken as broken:
                await self._migrate(broken, t_last)

    async def _events_of(self, attempt: Attempt) -> AsyncIterator[dict]:
        """`attempt`'s events, read by a task so that the wait can look at the worker's health;
        raises StreamBroken for what is migrated."""
        queue: asyncio.Queue = asyncio.Queue()
        pump = self._pump = asyncio.create_task(_pump(attempt, queue))
        worker = attempt.route.decode
        try:
            while True:
                try:
                    async with asyncio.timeout(HEALTH_POLL_S):
                        item = await queue.get()
                except TimeoutError:
                    if self._closed:  # closed by its owner while nobody reads it
                        return
                    if not worker.healthy:
                        raise StreamBroken(
                            "node_unhealthy", NodeAborted(f"decode node {worker.url} is unhealthy")
                        ) from None
                    continue
                if item is _END:
                    return
                if isinstance(item, httpx.HTTPError):
                    raise StreamBroken("connection", item)
                if isinstance(item, TimeoutError):
                    raise StreamBroken("idle_timeout", item)
                if isinstance(item, NodeAborted):
                    raise StreamBroken("stream_cut", item)
                if isinstance(item, BaseException):
                    raise item
                code = _node_abort(item)
                if code is not None:
                    message = (item.get("error") or {}).get("message") or code
                    raise StreamBroken(code, NodeAborted(str(message), code))
                yield item
        finally:
            pump.cancel()

    def _record(self, event: dict) -> None:
        ids = event.get("token_ids")
        if isinstance(ids, list):
            self.token_ids.extend(ids)
        text = event.get("text")
        if isinstance(text, str):
            self.text_chars += len(text)

    async def _migrate(self, broken: StreamBroken, t_last: float) -> None:
        """Closes the broken attempt and opens the stream's next on another decode node; re-raises
        the break's error when it may not or cannot move."""
        old, cfg, metrics = self.attempt, self.d.cfg, self.d.metrics
        # a slow node, or one that drains, is not a broken one: its breaker does not count it
        fault = broken.cause not in ("idle_timeout", "node_draining")
        old.close(False if fault else None, abort=True)
        if self._closed or self.migrations >= cfg.max_migrations:
            metrics.migration(broken.cause, "refused")
            raise broken.error
        if self.migrations == 0 and old.prefill_task is not None and old.prefill_meta:
            value = old.prefill_meta.get("cached_tokens")
            self._first_cached = value if isinstance(value, int) else None
        self.migrations += 1
        body: dict[str, Any] = dict(self.body)
        if self.token_ids:
            body["resume"] = {"token_ids": list(self.token_ids), "text_chars": self.text_chars}
        logger.warning(
            "rid=%s migrating the stream from %s (%s) after %d tokens",
            self.rid,
            old.route.decode.url,
            broken.cause,
            len(self.token_ids),
            extra={"rid": self.rid},
        )
        try:
            self.attempt = await self.d.open_attempt(
                body, self.key, True, self.model, exclude={old.route.decode.url}, migrating=True
            )
        except ApiError as exc:
            metrics.migration(broken.cause, "failed")
            logger.warning("rid=%s no decode node took the stream: %s", self.rid, exc)
            raise broken.error from None
        if self._closed:  # its owner closed it while the new attempt opened
            self.attempt.close(None, abort=True)
            raise broken.error
        metrics.migration(broken.cause, "resumed", len(self.token_ids))
        metrics.migration_stall.observe(time.monotonic() - t_last)
        if old.trace is not None:
            old.trace.migrated(self.attempt.rid, broken.cause, len(self.token_ids))


async def _pump(attempt: Attempt, queue: asyncio.Queue) -> None:
    """`attempt`'s events into `queue`, then _END or the error that ended them."""
    try:
        async for event in attempt.events():
            queue.put_nowait(event)
        queue.put_nowait(_END)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the reader hands every failure to the stream, which decides
        queue.put_nowait(exc)
