"""One request's answer at its node front: what it has received so far (`Pending`), and how PP0's
events become answer chunks: token runs coalesced into one chunk, the finish chunk with the
detokenizer's tail, the error chunk, and the meta_info every chunk carries."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.core import SamplingParams
from pdserve.engine.model.detokenizer import IncrementalDetokenizer
from pdserve.runtime.messages import ErrorEvent, Event, FinishEvent, TokenEvent


@dataclass
class Pending:
    rid: str
    prompt_tokens: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    token_ids: list[int] = field(default_factory=list)  # the output so far, resumed ones first
    resumed: int = 0  # output tokens another node generated (a migrated stream's)
    logprobs: list[list[Any]] = field(default_factory=list)
    t_start: float = field(default_factory=time.monotonic)
    t_first: float | None = None
    t_last: float | None = None  # when the last token chunk was made
    done: bool = False
    token_text: Any = None  # logprobs: each token's text and bytes (runtime/front/token_text.py)


def token_chunk(p: Pending, ev: TokenEvent) -> tuple[dict[str, Any], Event | None]:
    """One chunk of `ev` and the tokens already queued behind it (coalesced), and the event
    that ended the run, if one did."""
    toks, lps, end = [], [], None
    while True:
        toks.append(ev.token)
        if ev.logprob is not None:
            entry = [ev.token, ev.logprob, ev.top]
            lps.append(p.token_text.entry(*entry) if p.token_text else entry)
        if p.events.empty():
            break
        nxt = p.events.get_nowait()
        if not isinstance(nxt, TokenEvent):
            end = nxt
            break
        ev = nxt
    p.t_last = time.monotonic()
    if p.t_first is None:
        p.t_first = p.t_last
    p.token_ids.extend(toks)
    p.logprobs.extend(lps)
    chunk = {
        "rid": p.rid,
        "text": p.detok.add(toks),
        "token_ids": toks,
        "meta_info": meta_info(p, None, lps),
    }
    return chunk, end


def finish_chunk(p: Pending, ev: FinishEvent) -> dict[str, Any]:
    reason: dict[str, Any] = {"type": ev.kind}
    if ev.message:
        reason["message"] = ev.message
    if ev.matched is not None:
        reason["matched"] = ev.matched
    if ev.reason is not None:
        reason["code"] = ev.reason  # an abort's AbortReason: the router migrates some
    tail = p.detok.finish(ev.matched if isinstance(ev.matched, str) else None)
    p.done = True
    meta = meta_info(p, reason, [])
    meta["cached_tokens"] = ev.cached_len  # the prefix-cache hit at admission
    return {"rid": p.rid, "text": tail, "token_ids": [], "meta_info": meta}


def error_chunk(p: Pending, ev: ErrorEvent) -> dict[str, Any]:
    """The last chunk of a request that failed or was aborted: an OpenAI-style error (a client's
    when it names a field) and meta_info with an abort finish reason."""
    return {
        "rid": p.rid,
        "text": "",
        "token_ids": [],
        "error": {
            "message": ev.message,
            "type": "invalid_request_error" if ev.field else "server_error",
            "param": ev.field,
            "code": ev.reason,
        },
        "meta_info": meta_info(p, {"type": "abort", "message": ev.message, "code": ev.reason}, []),
    }


def meta_info(p: Pending, reason: dict[str, Any] | None, lps: list) -> dict[str, Any]:
    m: dict[str, Any] = {
        "prompt_tokens": p.prompt_tokens,
        "completion_tokens": len(p.token_ids),
        "finish_reason": reason,
    }
    if p.params.logprobs:
        m["logprobs"] = lps
    return m
