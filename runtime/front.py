"""A node's front process: HTTP (docs/PROTOCOL.md), tokenization, and the ZMQ link to PP0.

The front never schedules anything. It validates and tokenizes a request, hands it to PP0 as
`["add", rid, input_ids, sampling_params]`, and turns PP0's events (`token`, `finish`, `error`) back
into an HTTP answer. Only PP0 talks to the front, so every request gets exactly one answer.
It also collects every rank's stats (pool and queues) for /health, /server_info and /metrics.

Every message on the three ZMQ channels (requests to PP0, PP0's events, every rank's stats) is sealed
with the cluster secret (infra/channel_auth.py) and bounded in size (MAXMSGSIZE). The readers open
and decode inside their guard: a message that is unsealed, replayed, malformed or of the wrong shape
is dropped, counted in `dropped` (shown in /server_info) and logged once per kind; they keep reading.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import orjson
import zmq
import zmq.asyncio

from engine.core import ParamError, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from infra.channel_auth import AuthError, Opener, Sealer, limit_size

log = logging.getLogger("pdserve.front")


class RequestError(Exception):
    """A client error, answered with an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        }


RID_MAX = 256  # characters of a request id
EARLY_ABORTS_KEPT, EARLY_ABORT_TTL_S = (
    4096,
    120.0,
)  # abort-before-request tombstones: how many, how long
MAX_PENDING = 4096  # requests a node holds at once; beyond: 503
OVERLOADED = "node_overloaded"  # the error code of that 503 (with Retry-After)
# The front link's channels and the largest message each takes: a request carries at most a
# context of token ids; an event batch a few events per running request; stats a few counters
# and the per-iteration samples of half a second. Far above real traffic, far below harm.
REQ_CHANNEL, EVT_CHANNEL, STATS_CHANNEL = "front-req", "front-evt", "front-stats"
REQ_MAX_BYTES, EVT_MAX_BYTES, STATS_MAX_BYTES = 32 << 20, 16 << 20, 16 << 20
# Least length of each event kind PP0 sends (what the consumers index).
EVENT_LEN = {"token": 5, "finish": 5, "error": 4, "prefill_done": 4, "abort_unknown": 2}


def check_event(ev: Any) -> bool:
    return (
        type(ev) is list
        and len(ev) >= 2
        and type(ev[0]) is str
        and len(ev) >= EVENT_LEN.get(ev[0], 1 << 30)
        and type(ev[1]) is str
    )


@dataclass
class Pending:
    rid: str
    prompt_tokens: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[Any]] = field(default_factory=list)
    t_start: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    done: bool = False


class NodeFront:
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
        self.model_name, self.role, self.pp_size = model_name, role, pp_size
        self.max_context, self.vocab_size = max_context, vocab_size
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
        self.pending: dict[str, Pending] = {}
        # rids aborted before their /generate arrived (the router sends abort and generate on separate
        # connections, so an abort can overtake its request): that request is refused when it comes,
        # instead of waiting for a KV partner that already gave up (a bootstrap timeout later)
        self.early_aborts: OrderedDict[str, float] = OrderedDict()
        self.rank_stats: dict[int, dict[str, Any]] = {}
        self.rank_seen: dict[int, float] = {}
        self.dead: str | None = None  # why the node is unhealthy, once it is
        self.max_pending = MAX_PENDING
        self.metrics = None  # set by the app (runtime.metrics)
        self._tasks: list[asyncio.Task] = []

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
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def mark_dead(self, why: str) -> None:
        if self.dead is None:
            log.error("node unhealthy: %s", why)
            self.dead = why
        for p in list(self.pending.values()):
            p.events.put_nowait(["error", p.rid, f"node failure: {why}", None])

    def healthy(self, stale_s: float = 15.0) -> tuple[bool, str]:
        if self.dead:
            return False, self.dead
        now = time.monotonic()
        for r in range(self.pp_size):
            if r not in self.rank_seen:
                return False, f"pp_rank {r} is not ready yet"
            if now - self.rank_seen[r] > stale_s:
                return False, f"pp_rank {r} sent no stats for {now - self.rank_seen[r]:.0f} s"
        return True, "ok"

    # --- requests ---------------------------------------------------------------------------------
    def tokenize(self, body: dict[str, Any]) -> list[int]:
        given = [k for k in ("text", "messages", "input_ids") if body.get(k) is not None]
        if len(given) != 1:
            raise RequestError(
                400, "exactly one of 'text', 'messages', 'input_ids' is required", "text"
            )
        kind = given[0]
        if kind == "text":
            if not isinstance(body["text"], str):
                raise RequestError(400, "'text' must be a string", "text")
            ids = self.tok(body["text"])["input_ids"]
        elif kind == "messages":
            msgs = body["messages"]
            if (
                not isinstance(msgs, list)
                or not msgs
                or not all(
                    isinstance(m, dict)
                    and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)
                    for m in msgs
                )
            ):
                raise RequestError(
                    400,
                    "'messages' must be a non-empty list of {role, content} strings",
                    "messages",
                )
            text = self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            ids = self.tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                for t in ids
            ):
                raise RequestError(
                    400,
                    f"'input_ids' must be a list of integers in [0, {self.vocab_size})",
                    "input_ids",
                )
        if not ids:
            raise RequestError(400, f"the prompt ('{kind}') is empty", kind)
        return list(ids)

    def admit(self, body: dict[str, Any], ids: list[int] | None = None) -> Pending:
        """Checks and queues a request; `ids`: its prompt, if the caller tokenised it already."""
        if self.dead:
            raise RequestError(503, f"node is unhealthy: {self.dead}")
        if len(self.pending) >= self.max_pending:
            raise RequestError(
                503,
                f"node has {len(self.pending)} requests pending (its limit); retry later",
                code=OVERLOADED,
            )
        try:
            params = SamplingParams.from_dict(body.get("sampling_params"))
        except ParamError as e:
            raise RequestError(400, str(e), e.field) from None
        except TypeError as e:
            raise RequestError(400, f"sampling_params: {e}", "sampling_params") from None
        if ids is None:
            ids = self.tokenize(body)
        if len(ids) + params.max_tokens > self.max_context:
            raise RequestError(
                400,
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context limit of {self.max_context} tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str) or len(rid) > RID_MAX:
            raise RequestError(
                400, f"'rid' must be a string of at most {RID_MAX} characters", "rid"
            )
        if rid in self.pending:
            raise RequestError(400, f"request id {rid!r} is already in use", "rid")
        aborted_at = self.early_aborts.pop(rid, None)
        if aborted_at is not None and time.monotonic() - aborted_at < EARLY_ABORT_TTL_S:
            raise RequestError(
                409, f"request {rid!r} was aborted before it arrived", "rid", "aborted"
            )
        extra = self.extra_add_fields(body)
        p = Pending(rid, len(ids), params, IncrementalDetokenizer(self.tok, params.stop))
        self.pending[rid] = p
        self.send([self.add_kind(), rid, ids, params.to_dict()] + extra)
        return p

    def extra_add_fields(self, body: dict[str, Any]) -> list[Any]:
        """PD fronts append their fields (bootstrap address and room) to the add message."""
        return []

    def add_kind(self) -> str:
        return "add"

    def send(self, msg: list[Any]) -> None:
        self.req_sock.send(self._sealer.seal(msgpack.packb(msg, use_bin_type=True)))

    def abort(self, rid: str, why: str = "aborted by client") -> bool:
        if rid not in self.pending:
            self.early_aborts[rid] = time.monotonic()
            self.early_aborts.move_to_end(rid)
            while len(self.early_aborts) > EARLY_ABORTS_KEPT:
                self.early_aborts.popitem(last=False)
            return False
        self.send(["abort", rid, why])
        return True

    async def events(self, p: Pending) -> AsyncIterator[dict[str, Any]]:
        """Chunks for one request (deltas), the last one with finish_reason; aborts if cancelled."""
        try:
            while True:
                ev = await p.events.get()
                kind = ev[0]
                if kind == "token":
                    toks = [ev[2]]
                    lps = [[ev[2], ev[3], ev[4]]] if ev[3] is not None else []
                    # Coalesce what is already queued into one chunk.
                    fin = None
                    while not p.events.empty() and fin is None:
                        nxt = p.events.get_nowait()
                        if nxt[0] == "token":
                            toks.append(nxt[2])
                            if nxt[3] is not None:
                                lps.append([nxt[2], nxt[3], nxt[4]])
                        else:
                            fin = nxt
                    if p.t_first is None:
                        p.t_first = time.monotonic()
                    p.token_ids.extend(toks)
                    p.logprobs.extend(lps)
                    chunk = {
                        "rid": p.rid,
                        "text": p.detok.add(toks),
                        "token_ids": toks,
                        "meta_info": self._meta(p, None, lps),
                    }
                    if fin is None:
                        yield chunk
                        continue
                    yield chunk
                    ev, kind = fin, fin[0]
                if kind == "finish":
                    reason = {"type": ev[2]}
                    if ev[3]:
                        reason["message"] = ev[3]
                    if ev[4] is not None:
                        reason["matched"] = ev[4]
                    tail = p.detok.finish(ev[4] if isinstance(ev[4], str) else None)
                    p.done = True
                    self._observe(p, ev[2])
                    yield {
                        "rid": p.rid,
                        "text": tail,
                        "token_ids": [],
                        "meta_info": self._meta(p, reason, []),
                    }
                    return
                if kind == "error":
                    p.done = True
                    self._observe(p, "abort")
                    yield {
                        "rid": p.rid,
                        "text": "",
                        "token_ids": [],
                        "error": {
                            "message": ev[2],
                            "type": "invalid_request_error" if ev[3] else "server_error",
                            "param": ev[3],
                            "code": None,
                        },
                        "meta_info": self._meta(p, {"type": "abort", "message": ev[2]}, []),
                    }
                    return
        finally:
            if not p.done and self.dead is None and p.rid in self.pending:
                self.send(["abort", p.rid, "client disconnected"])

    def _meta(self, p: Pending, reason, lps) -> dict[str, Any]:
        m = {
            "prompt_tokens": p.prompt_tokens,
            "completion_tokens": len(p.token_ids),
            "finish_reason": reason,
        }
        if p.params.logprobs:
            m["logprobs"] = lps
        return m

    def _observe(self, p: Pending, finish: str) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(p, finish)

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
        events = msgpack.unpackb(payload, raw=False)
        if type(events) is not list:
            raise ValueError(f"an event batch is a list, got {type(events).__name__}")
        for ev in events:
            if not check_event(ev):
                self._drop("events:bad_event", ValueError(f"event {str(ev)[:80]}"))
                continue
            if ev[0] == "abort_unknown":
                p = self.pending.get(ev[1])
                if p is not None and not p.done:
                    ev = ["error", ev[1], "aborted", None]
                else:
                    continue
            p = self.pending.get(ev[1])
            if p is not None:
                p.events.put_nowait(ev)
                if ev[0] in ("finish", "error", "prefill_done"):
                    del self.pending[ev[1]]  # over on the ranks; `p` still streams its queue

    async def _read_stats(self) -> None:
        while True:
            raw = await self.stats_sock.recv()
            try:
                self._on_stats(raw)
            except AuthError as e:
                self._drop(f"stats:{e.reason}", e)
            except Exception as e:
                self._drop("stats:malformed", e)

    def _on_stats(self, raw: bytes) -> None:
        sender, payload = self._stats_opener.open(raw)
        st = msgpack.unpackb(payload, raw=False)
        r = st["pp_rank"]
        if type(r) is not int or not 0 <= r < self.pp_size or sender != f"pp{r}":
            raise ValueError(f"stats of pp_rank {r!r} from {sender}")
        self.rank_stats[r] = st
        self.rank_seen[r] = time.monotonic()
        if self.metrics is not None:
            try:
                self.metrics.ingest(st)
            except (TypeError, ValueError, KeyError) as e:
                log.warning("bad metric samples from pp_rank %d dropped: %s", r, e)

    def server_info(self) -> dict[str, Any]:
        ok, why = self.healthy()
        return {
            "model": self.model_name,
            "role": self.role,
            "max_context": self.max_context,
            "pid": os.getpid(),
            "pp_size": self.pp_size,
            "bootstrap_port": None,
            "healthy": ok,
            "status": why,
            "load": {
                "running": sum(
                    s.get("running", 0) for s in self.rank_stats.values() if s["pp_rank"] == 0
                ),
                "waiting": self.rank_stats.get(0, {}).get("waiting", 0),
                "in_flight": len(self.pending),
            },
            "ranks": [self.rank_stats.get(r) for r in range(self.pp_size)],
            "dropped_messages": dict(self.dropped),
        }


def sse(obj: dict[str, Any] | str) -> bytes:
    if isinstance(obj, str):
        return f"data: {obj}\n\n".encode()
    return b"data: " + orjson.dumps(obj) + b"\n\n"
