"""A node's front process: HTTP (docs/PROTOCOL.md), tokenization, and the ZMQ link to PP0.

The front never schedules anything. It validates and tokenizes a request, hands it to PP0 as an
`AddRequest` (runtime/messages.py), and turns PP0's events (`TokenEvent`, `FinishEvent`,
`ErrorEvent`) back into an HTTP answer. Only PP0 talks to the front, so every request gets exactly
one answer. It also collects every rank's stats (pool and queues) for /health, /server_info and
/metrics (runtime/front/rank_reports.py).

Every message on the three ZMQ channels (requests to PP0, PP0's events, every rank's stats) is
sealed with the cluster secret (infra/channel_auth.py) and bounded in size (MAXMSGSIZE). The readers
open and decode inside their guard: a message that is unsealed, replayed, malformed or of the wrong
shape is dropped, counted in `dropped` (shown in /server_info) and logged once per kind; they keep
reading."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from pdserve.engine.core import SamplingParams
from pdserve.engine.model.detokenizer import IncrementalDetokenizer
from pdserve.infra.channel_auth import AuthError, Opener, Sealer, limit_size
from pdserve.runtime.front.answer import Pending, error_chunk, finish_chunk, token_chunk
from pdserve.runtime.front.chat_template import tool_call_format
from pdserve.runtime.front.guide_gate import GuideGate
from pdserve.runtime.front.metrics import MetricsExtension
from pdserve.runtime.front.prompt import (
    RequestError,
    Resume,
    check_context,
    prompt_ids,
    request_rid,
    request_share,
    resume_point,
    sampling_params,
)
from pdserve.runtime.front.rank_reports import RankReports
from pdserve.runtime.front.token_text import TokenBytes, TokenText
from pdserve.runtime.front.tracing import NodeTracing
from pdserve.runtime.messages import (
    AbortRequest,
    AbortUnknownEvent,
    AddRequest,
    ErrorEvent,
    Event,
    FinishEvent,
    RankStats,
    TokenEvent,
    encode,
    unpack,
)
from pdserve.runtime.rank_spec import RankSpec
from pdserve.runtime.reasons import AbortReason

log = logging.getLogger("pdserve.front")


# abort-before-request tombstones: how many, how long
EARLY_ABORTS_KEPT, EARLY_ABORT_TTL_S = 4096, 120.0
MAX_PENDING = 4096  # requests a node holds at once; beyond: 503
OVERLOADED = "node_overloaded"  # the error code of that 503 (with Retry-After)
# The front link's channels and the largest message each takes: a request carries at most a
# context of token ids; an event batch a few events per running request; stats a few counters
# and the per-iteration samples of half a second. Far above real traffic, far below harm.
REQ_CHANNEL, EVT_CHANNEL, STATS_CHANNEL = "front-req", "front-evt", "front-stats"
REQ_MAX_BYTES, EVT_MAX_BYTES, STATS_MAX_BYTES = 32 << 20, 16 << 20, 16 << 20


class NodeFront(RankReports):
    # the finish reasons this front's metrics show from the first scrape (runtime/front/metrics.py),
    # and what a kind of node adds to them: a PD front names its own (prefill_done; the KV
    # transfer's)
    finish_reasons: tuple[str, ...] = ("stop", "length", "abort")
    metrics_extension: type[MetricsExtension] = MetricsExtension
    rank_spec: type[RankSpec] = RankSpec  # what its ranks start with (a PD front: PDRankSpec)
    metrics_roles: tuple[str, ...] = ()  # roles besides its own whose series exist from the start

    def __init__(
        self,
        tokenizer,
        *,
        model_name: str,
        role: str,
        pp_size: int,
        max_context: int,
        vocab_size: int,
        host: str = "127.0.0.1",
        stats_port: int = 0,
    ):
        self.tok = tokenizer
        self.tool_call_format = tool_call_format(tokenizer)  # runtime/front/chat_template.py
        self.model_name, self.role, self.pp_size = model_name, role, pp_size
        self.max_context, self.vocab_size = max_context, vocab_size
        self._open_link(host, stats_port)
        self.pending: dict[str, Pending] = {}
        # rids aborted before their /generate arrived (the router sends abort and generate on
        # separate connections, so an abort can overtake its request): that request is refused when
        # it comes, instead of waiting for a KV partner that already gave up (a bootstrap timeout
        # later)
        self.early_aborts: OrderedDict[str, float] = OrderedDict()
        self.rank_stats: dict[int, RankStats] = {}
        self.follower_stats: dict[tuple[int, int], RankStats] = {}
        self.rank_seen: dict[int, float] = {}
        self.dead: str | None = None  # why the node is unhealthy, once it is
        self.draining = False  # runtime/front/drain.py: the router stops choosing the node
        self.refusing: str | None = None  # why new requests get a retryable 503 (a drain's end)
        self.max_pending = MAX_PENDING
        self.prefix_cache = True  # its ranks keep finished prompts' KV (not --no-prefix-cache)
        self.sampling_defaults: dict[
            str, Any
        ] = {}  # the model's (engine.loader.load_sampling_defaults)
        self.token_bytes: TokenBytes | None = None  # made at the first logprobs request
        self.metrics = None  # set by the app (runtime.metrics)
        self.tracing = NodeTracing(role, pp_size)  # inert unless a request brings a traceparent
        # guides must compile in time before a rank sees them (serve.py sets the bound); the
        # tokenizer may still be loading (front/tokenizer_loading.py): the gate reads it when used
        self.guide_gate = GuideGate(tokenizer, vocab_size, None, 10.0)
        self._tasks: list[asyncio.Task] = []

    def _open_link(self, host: str, stats_port: int) -> None:
        """The ZMQ link to the ranks: requests to PP0, PP0's events, every rank's stats."""
        self.ctx = zmq.asyncio.Context()
        self.req_sock = self.ctx.socket(zmq.PUSH)
        self.req_sock.setsockopt(zmq.SNDHWM, 0)
        self.evt_sock = self.ctx.socket(zmq.PULL)
        self.stats_sock = self.ctx.socket(zmq.PULL)
        limit_size(self.req_sock, REQ_MAX_BYTES)  # takes nothing in; bounded like every socket
        limit_size(self.evt_sock, EVT_MAX_BYTES)
        limit_size(self.stats_sock, STATS_MAX_BYTES)
        self._sealer = Sealer(REQ_CHANNEL, "front")
        self._evt_opener, self._stats_opener = Opener(EVT_CHANNEL), Opener(STATS_CHANNEL)
        self.dropped: Counter[str] = Counter()  # messages the readers dropped, by channel:reason
        # PP0 always runs on this host (node-rank 0), so requests and events travel over unix
        # sockets in a directory only this user can enter (mkdtemp: 0700): a bound PUSH socket hands
        # its messages round-robin to every peer that connects, so on a TCP port, even a loopback
        # one, any local process could take a share of the requests (reading the prompts, and
        # leaving those requests unanswered). Only the stats of ranks on other hosts come in over
        # the network, sealed.
        self._ipc_dir = tempfile.mkdtemp(prefix="pdserve-front-")
        self.req_addr, self.evt_addr = f"ipc://{self._ipc_dir}/req", f"ipc://{self._ipc_dir}/evt"
        self.req_sock.bind(self.req_addr)
        self.evt_sock.bind(self.evt_addr)
        if stats_port:  # multi-host: ranks on other hosts report to a port they can derive
            self.stats_sock.bind(f"tcp://{host}:{stats_port}")
            self.stats_addr = f"tcp://{host}:{stats_port}"
        else:
            self.stats_addr = self._bind(self.stats_sock, host)

    @staticmethod
    def _bind(sock, host: str) -> str:
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._read_events()),
            asyncio.create_task(self._read_stats()),
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.ctx.destroy(linger=0)
        self.tracing.close()
        self.guide_gate.close()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def mark_dead(self, why: str) -> None:
        if not self.dead:
            log.error("node unhealthy: %s", why)
            self.dead = why
        for p in list(self.pending.values()):
            p.events.put_nowait(
                ErrorEvent(p.rid, f"node failure: {why}", None, AbortReason.NODE_FAILURE)
            )

    # --- requests ---------------------------------------------------------------------------------
    def tokenize(self, body: dict[str, Any]) -> list[int]:
        return prompt_ids(self.tok, body, self.vocab_size)

    def admit(
        self, body: dict[str, Any], ids: list[int] | None = None, traceparent: str | None = None
    ) -> Pending:
        """Checks and queues a request; `ids`: its prompt, if the caller tokenised it already;
        `traceparent`: the caller's trace context (the request's stages are traced under it)."""
        if self.dead:
            raise RequestError(503, f"node is unhealthy: {self.dead}")
        if self.refusing:
            raise RequestError(503, self.refusing, code=OVERLOADED)
        if len(self.pending) >= self.max_pending:
            raise RequestError(
                503,
                f"node has {len(self.pending)} requests pending (its limit); retry later",
                code=OVERLOADED,
            )
        params, to_end = sampling_params(body, self.sampling_defaults)
        if ids is None:
            ids = self.tokenize(body)
        if to_end:
            params = replace(params, max_tokens=self.tokens_left(len(ids)))
        check_context(len(ids), params.max_tokens, self.max_context)
        resume = resume_point(body, self.vocab_size, params.max_tokens)
        rid = request_rid(body)
        if rid in self.pending:
            raise RequestError(400, f"request id {rid!r} is already in use", "rid")
        aborted_at = self.early_aborts.pop(rid, None)
        if aborted_at is not None and time.monotonic() - aborted_at < EARLY_ABORT_TTL_S:
            raise RequestError(
                409, f"request {rid!r} was aborted before it arrived", "rid", "aborted"
            )
        msg = replace(self.add_request(rid, ids, params, body), share=request_share(body))
        detok = IncrementalDetokenizer(self.tok, params.stop)
        if resume is not None:
            msg = self._resumed(msg, resume, detok)
        tp = self.tracing.begin(rid, traceparent) if traceparent else None
        if tp is not None:
            msg = replace(msg, traceparent=tp)
        resumed = list(resume.token_ids) if resume is not None else []
        p = Pending(rid, len(ids), params, detok, token_ids=resumed, resumed=len(resumed))
        if params.logprobs:
            self.token_bytes = self.token_bytes or TokenBytes(self.tok)
            p.token_text = TokenText(self.token_bytes)
        self.pending[rid] = p
        self.send(msg)
        return p

    @staticmethod
    def _resumed(msg: AddRequest, resume: Resume, detok: IncrementalDetokenizer) -> AddRequest:
        """The request continued from `resume`: its tokens go to the ranks as output (a prefill
        node prefills them after the prompt and samples the next; a decode node of the same room
        receives their KV), and the detokenizer starts where the client's text ends."""
        try:
            detok.resume(resume.token_ids, resume.text_chars)
        except ValueError as e:
            raise RequestError(400, f"'resume.text_chars': {e}", "resume.text_chars") from None
        return replace(msg, output_ids=resume.token_ids)

    def tokens_left(self, prompt_len: int) -> int:
        """max_tokens for a request that sends null (an OpenAI chat without one): the rest of the
        context, or of the KV pool if smaller, capped by the model's max_new_tokens; at least 1."""
        pool = min(
            (s.num_pages * s.page_size for s in self.rank_stats.values()),
            default=self.max_context,
        )
        left, cap = (
            min(self.max_context, pool) - prompt_len,
            self.sampling_defaults.get("max_tokens"),
        )
        return max(1, min(left, cap) if cap else left)

    def add_request(
        self, rid: str, ids: list[int], params: SamplingParams, body: dict[str, Any]
    ) -> AddRequest:
        """The message that starts a request on the ranks; a PD front checks and adds its own
        fields (room, bootstrap server) and raises RequestError naming a bad one."""
        return AddRequest(rid, ids, params.to_dict())

    async def answer(self, p: Pending) -> dict[str, Any] | None:
        """The whole answer of a front whose requests end before any token streams (prefill: at
        the KV hand-off); None: the app streams or collects the request's tokens."""
        return None

    def describe(self) -> str:
        """What the start-up line adds about this front (prefill: its bootstrap server)."""
        return ""

    def add_routes(self, app: Any, check_internal: Any) -> None:
        """A front's own HTTP endpoints (decode: the bootstrap allowlist)."""

    def send(self, msg: Any) -> None:
        self.req_sock.send(self._sealer.seal(msgpack.packb(encode(msg), use_bin_type=True)))

    def metrics_role(self) -> str:
        """The `role` label of its metrics now (an elastic front's follows its flips)."""
        return self.role

    def abort(self, rid: str, why: AbortReason = AbortReason.CLIENT_ABORT) -> bool:
        if rid not in self.pending:
            self.early_aborts[rid] = time.monotonic()
            self.early_aborts.move_to_end(rid)
            while len(self.early_aborts) > EARLY_ABORTS_KEPT:
                self.early_aborts.popitem(last=False)
            return False
        self.send(AbortRequest(rid, why))
        return True

    async def events(self, p: Pending) -> AsyncIterator[dict[str, Any]]:
        """Chunks for one request (deltas), the last one with finish_reason; aborts if cancelled."""
        try:
            while True:
                ev = await p.events.get()
                if isinstance(ev, TokenEvent):
                    prev = p.t_last
                    chunk, ev = token_chunk(p, ev)
                    if self.metrics is not None:
                        self.metrics.observe_chunk(p, prev, len(chunk["token_ids"]))
                    yield chunk
                    if ev is None:
                        continue
                if isinstance(ev, FinishEvent):
                    chunk = finish_chunk(p, ev)
                    self._observe(p, ev.kind, ev.reason)
                    yield chunk
                    return
                if isinstance(ev, ErrorEvent):
                    p.done = True
                    self._observe(p, "abort", ev.reason)
                    yield error_chunk(p, ev)
                    return
        finally:
            if not p.done and self.dead is None and p.rid in self.pending:
                self.disconnected(p)

    def disconnected(self, p: Pending) -> None:
        """The caller stopped reading before the end: the ranks drop the request, and it counts
        as aborted now (nobody reads its last event)."""
        p.done = True
        self.send(AbortRequest(p.rid, AbortReason.CLIENT_DISCONNECT))
        self._observe(p, "abort", AbortReason.CLIENT_DISCONNECT)

    def _observe(self, p: Pending, finish: str, reason: str | None = None) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(p, finish, reason)

    # --- background readers -----------------------------------------------------------------------
    def _drop(self, reason: str, err: Exception) -> None:
        self.dropped[reason] += 1
        if self.dropped[reason] == 1:  # a flood must not flood the log: the first of each kind
            log.warning("dropped a message (%s): %s; further ones are only counted", reason, err)

    async def _read_events(self) -> None:
        while True:
            raw = await self.evt_sock.recv()
            try:
                self._on_events(raw)
            except AuthError as e:
                self._drop(f"events:{e.reason}", e)
            except Exception as e:  # bad bytes or shapes never end the reader (the node would hang)
                self._drop("events:malformed", e)

    def _on_events(self, raw: bytes) -> None:
        _, payload = self._evt_opener.open(raw)
        events, bad = unpack(payload)
        for err in bad:
            self._drop("events:bad_event", err)
        for ev in events:
            if not isinstance(ev, Event):
                self._drop("events:bad_event", ValueError(f"{type(ev).__name__} is no event"))
                continue
            p = self.pending.get(ev.rid)
            if p is None:
                continue
            if isinstance(ev, AbortUnknownEvent):
                if p.done:
                    continue
                ev = ErrorEvent(ev.rid, "aborted", None, AbortReason.CLIENT_ABORT)
            p.events.put_nowait(ev)
            if ev.terminal:
                del self.pending[ev.rid]  # over on the ranks; `p` still streams its queue
                if self.tracing.requests:
                    self.tracing.end(
                        ev.rid, getattr(ev, "kind", None) or getattr(ev, "reason", ev.TAG)
                    )
