"""Typed messages between a node's processes, and their one strict codec.

    front -> PP0      AddRequest, AbortRequest (a PD node adds its own kinds: pd_common/messages.py)
    PP0 -> ranks      the same requests, forwarded down the PP chain as the meta stream
    PP0 -> front      TokenEvent, FinishEvent, ErrorEvent, AbortUnknownEvent (+ the PD kinds)
    rank -> front     RankStats (+ a PD rank's KVRankStats, its StatsExtension), twice a second

A message travels as a msgpack list `[tag, field, ...]` in field order. `decode` checks the tag, the
number of fields and every field's type (from its annotation) and bound (runtime/message_checks.py),
and raises MessageError: readers drop and count what it rejects, and never die of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

from pdserve.engine.core import ANONYMOUS_SHARE, ParamError, Share
from pdserve.infra.tracing import valid_traceparent
from pdserve.runtime.message_checks import MessageError, build
from pdserve.runtime.reasons import check_reason

_BY_TAG: dict[str, type] = {}


def message(tag: str):
    """Registers a dataclass as the message `tag` (unique across the node's channels)."""

    def register(cls):
        if tag in _BY_TAG:
            raise ValueError(f"message tag {tag!r} is taken by {_BY_TAG[tag].__name__}")
        cls.TAG = tag
        _BY_TAG[tag] = cls
        return cls

    return register


_NAMES: dict[type, tuple[str, ...]] = {}


def encode(msg: Any) -> list:
    """The wire form of a registered message (or a nested dataclass: its fields only)."""
    cls = type(msg)
    names = _NAMES.get(cls)
    if names is None:  # per token on the hot path: look the fields up once per class
        names = _NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    values = [_to_wire(getattr(msg, n)) for n in names]
    tag = getattr(cls, "TAG", None)
    return values if tag is None else [tag, *values]


def decode(obj: Any) -> Any:
    """A registered message from its wire form; MessageError if it is not exactly one."""
    if type(obj) is not list or not obj or type(obj[0]) is not str:
        raise MessageError("a message is a non-empty list starting with its tag")
    cls = _BY_TAG.get(obj[0])
    if cls is None:
        raise MessageError(f"unknown message tag {obj[0][:40]!r}")
    return build(cls, obj[1:])


def from_mapping(cls: type, d: Any) -> Any:
    """A message from a {field: value} map (a readable form, e.g. JSON on a command line): exactly
    the class's fields, each checked as `decode` checks it."""
    names = [f.name for f in dataclasses.fields(cls)]
    if type(d) is not dict or set(d) != set(names):
        got = sorted(d) if type(d) is dict else type(d).__name__
        raise MessageError(f"{cls.__name__} needs exactly the fields {names}, got {got}")
    return build(cls, [d[n] for n in names])


def pack(msgs: list[Any]) -> bytes:
    return msgpack.packb([encode(m) for m in msgs], use_bin_type=True)


def unpack(data: bytes) -> tuple[list[Any], list[MessageError]]:
    """A batch: the messages that decode, and the errors of those that did not."""
    try:
        batch = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage; all mean "not ours"
        raise MessageError(f"not msgpack: {type(e).__name__}") from None
    if type(batch) is not list:
        raise MessageError(f"a batch is a list, got {type(batch).__name__}")
    good, bad = [], []
    for obj in batch:
        try:
            good.append(decode(obj))
        except MessageError as e:
            bad.append(e)
    return good, bad


_PLAIN = (int, float, str, bool, type(None), dict)


def _to_wire(v: Any) -> Any:
    if type(v) in _PLAIN:
        return v
    if type(v) is list and v and type(v[0]) in _PLAIN and type(v[-1]) in _PLAIN:
        return v  # token ids: nothing nested to convert
    if isinstance(v, (tuple, list)):
        return [_to_wire(x) for x in v]
    if dataclasses.is_dataclass(v):
        return encode(v)
    return v


# --- front -> PP0 (and down the PP chain) ---------------------------------------------------------
@message("add")
@dataclass(frozen=True)
class AddRequest:
    """A new request: its prompt and its sampling parameters (SamplingParams.to_dict)."""

    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    # W3C trace context of the node's request span: the ranks record its stages (docs/TRACING.md)
    traceparent: str | None = field(default=None, kw_only=True)
    # tokens another node generated before this one continues the request (a migrated stream):
    # prefilled after the prompt, and counted as output by max_tokens, penalties, seeds, grammars
    output_ids: list[int] = field(default_factory=list, kw_only=True)
    # its tenant, weight and priority, for the waiting queue's fair order (engine/fair_queue.py)
    share: Share = field(default=ANONYMOUS_SHARE, kw_only=True)

    def validate(self) -> None:
        if not self.input_ids or min(self.input_ids) < 0:
            raise MessageError("AddRequest.input_ids: a non-empty list of token ids")
        try:
            self.share.check()
        except ParamError as e:
            raise MessageError(f"AddRequest.share.{e}") from None
        if self.output_ids and min(self.output_ids) < 0:
            raise MessageError("AddRequest.output_ids: token ids are >= 0")
        if self.traceparent is not None and not valid_traceparent(self.traceparent):
            raise MessageError("AddRequest.traceparent: not a W3C traceparent")


@message("abort")
@dataclass(frozen=True)
class AbortRequest:
    rid: str
    reason: str  # an AbortReason code (runtime/reasons.py)

    def validate(self) -> None:
        _check_reason(self.reason, "AbortRequest.reason")


def _check_reason(reason: str | None, where: str, optional: bool = False) -> None:
    try:
        check_reason(reason, where, optional)
    except ValueError as e:
        raise MessageError(str(e)) from None


# --- PP0 -> front ---------------------------------------------------------------------------------
class Event:
    """What PP0 tells the front about one request; `terminal`: the request is over on the ranks."""

    terminal: ClassVar[bool] = False
    rid: str


@message("token")
@dataclass(frozen=True)
class TokenEvent(Event):
    rid: str
    token: int
    logprob: float | None  # None unless the request asked for logprobs
    top: list[tuple[int, float]] | None  # (token id, logprob) pairs, when asked for


@message("finish")
@dataclass(frozen=True)
class FinishEvent(Event):
    terminal: ClassVar[bool] = True
    rid: str
    kind: str  # FinishReason kind: stop, length, abort
    message: str | None
    matched: int | str | None  # the stop token id or stop string that ended it
    prompt_len: int
    output_len: int
    cached_len: int  # prompt tokens the prefix cache served
    reason: str | None = None  # kind "abort": its AbortReason code

    def validate(self) -> None:
        _check_reason(self.reason, "FinishEvent.reason", optional=True)


@message("error")
@dataclass(frozen=True)
class ErrorEvent(Event):
    terminal: ClassVar[bool] = True
    rid: str
    message: str
    field: str | None  # the request field at fault (a client error); None: a server-side failure
    reason: str  # its AbortReason code (runtime/reasons.py): the metrics' label, never free text

    def validate(self) -> None:
        _check_reason(self.reason, "ErrorEvent.reason")


@message("abort_unknown")
@dataclass(frozen=True)
class AbortUnknownEvent(Event):
    """An abort for a request no rank knows (it finished, or never arrived)."""

    rid: str


# --- rank -> front --------------------------------------------------------------------------------
SPANS_PER_PUSH = 2048  # span records one stats push carries at most (runtime/rank/spans.py)


@dataclass(frozen=True)
class SpanRecord:
    """A finished stage of a traced request on one rank, timed by the rank's own clock (Unix ns).
    `parent`: the name of a span of the same request and rank, "" for the node's request span;
    `seq` tells repeated names (prefill chunks) apart. The front gives it its ids."""

    rid: str
    name: str
    parent: str
    seq: int
    start_ns: int
    end_ns: int
    attrs: dict[str, int | float | str]
    events: list[tuple[str, int]]


@dataclass(frozen=True)
class StatsExtension:
    """What a kind of loop adds to its rank's stats (SlotLoop.stats_extension; a PD loop: its KV
    transfer counters). A subclass is a registered message: it travels with its tag, so the front
    decodes its own node's kind and drops any other."""

    key: ClassVar[str] = "ext"  # its key in /server_info's rank entry
    tagged: ClassVar[bool] = True  # runtime/message_checks.py: the field takes any tagged subclass

    @classmethod
    def from_wire(cls, v: Any, where: str) -> StatsExtension:
        msg = decode(v)
        if not isinstance(msg, cls):
            raise MessageError(f"{where}: {type(msg).__name__} is no {cls.__name__}")
        return msg


MAX_TP = 64  # TP ranks a stage may have, as far as a front takes their stats


def stats_sender(pp_rank: int, tp_rank: int) -> str:
    """The sealed sender name of a rank's stats push, which the front checks against the stats."""
    return f"pp{pp_rank}" if tp_rank == 0 else f"pp{pp_rank}.tp{tp_rank}"


@message("stats")
@dataclass(frozen=True)
class RankStats:
    """One rank's state for the front's /health, /server_info and /metrics."""

    pp_rank: int
    pid: int
    iterations: int
    forwards: int
    held_pages: int  # pages live requests hold (prefix-cache pages they lock included)
    used_tokens: int
    num_pages: int
    free_pages: int
    page_size: int
    cached_pages: int
    locked_cached_pages: int  # prefix-cache pages a request still locks (not evictable)
    prefix_hit_tokens: int
    retractions: int
    queues: dict[str, int]  # requests per queue: waiting, running, retracted + a PD loop's own
    samples: dict[str, list[float]]  # latency samples since the last push, by name
    front_dropped: dict[str, int] = field(default_factory=dict)  # PP0: bad front messages
    ext: StatsExtension | None = None  # the node kind's own counters
    dtype: str = ""  # the dtype the rank computes in (--dtype auto resolved)
    spans: list[SpanRecord] = field(default_factory=list)  # traced requests' stages, since last
    # > 0: a TP follower's stats; the front reads only their `ext` (its own KV transfer counters)
    tp_rank: int = 0
    sliding_pages: int = 0  # a windowed pool's sliding pages (engine/window_pages.py); 0: none
    sliding_free_pages: int = 0

    def validate(self) -> None:
        if len(self.spans) > SPANS_PER_PUSH:
            raise MessageError(f"RankStats.spans: more than {SPANS_PER_PUSH} records")
        if not 0 <= self.tp_rank < MAX_TP:
            raise MessageError(f"RankStats.tp_rank: {self.tp_rank} is not in [0, {MAX_TP})")

    def to_json(self) -> dict[str, Any]:
        """The stats as /server_info shows them: the queues inline, as before they were typed."""
        d = dataclasses.asdict(self)
        d.pop("spans")  # the front's tracing takes them
        d.update(d.pop("queues"))
        ext = d.pop("ext")  # shown under its own key (a PD rank's: "kv")
        if self.ext is not None:  # `ext` is its asdict
            d[self.ext.key] = ext
        return d


# --- last rank -> PP0 -> ... (the output ring, runtime/rank/slot_loop.py)
# ------------------------------
def out_to_wire(out: Any) -> list | None:  # a SampleOut
    if out is None:
        return None
    tops = (
        [[list(p) for p in row] for row in out.top_logprobs]
        if out.top_logprobs is not None
        else None
    )
    return [out.token_ids, out.logprobs, tops]


def ring_to_wire(out: Any, ready: list[tuple[str, int]]) -> list:
    """A ring message: the last rank's SampleOut of a batch, and the requests whose guides it has
    compiled since, with each compiled guide's bytes (engine/grammar.py `compiled_guides`)."""
    return [out_to_wire(out), [list(x) for x in ready]]


def ring_from_wire(w: list | None) -> tuple[Any, list[tuple[str, int]]]:
    """(SampleOut or None, [(rid, bytes)]) of a ring message; None (no message): nothing."""
    if w is None:
        return None, []
    return out_from_wire(w[0]), [(str(r), int(n)) for r, n in w[1]]


def out_from_wire(w: list | None) -> Any:
    """The SampleOut of a ring message (imported here: the front reads this module, no torch)."""
    from pdserve.engine.batch import SampleOut

    if w is None:
        return None
    tops = [[(int(i), float(v)) for i, v in row] for row in w[2]] if w[2] is not None else None
    return SampleOut(list(w[0]), w[1], tops)
