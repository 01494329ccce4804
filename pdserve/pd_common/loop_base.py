"""What both PD loops share: the PD loop base (its request record, queues' timers, admission of a
PD request, the end of a request), the consensus ring over the PP group, and the aux payload
(first token + logprobs) codec."""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from pdserve.consensus.kvpoll import KVPoll
from pdserve.consensus.rank_checker import rank_consensus
from pdserve.consensus.transport import InMemoryRing, PPGroupTransport, RingTransport
from pdserve.consensus.vote import Ballot, RingVote
from pdserve.engine.core import ParamError, Req, SamplingParams
from pdserve.engine.grammar import hold_for_guide
from pdserve.kv_transfer.base import BaseKVManager, BaseKVReceiver, BaseKVSender
from pdserve.pd_common.messages import KVRankStats, PDAddRequest, SetRole
from pdserve.runtime.messages import AddRequest, ErrorEvent
from pdserve.runtime.rank.pp_comm import Msg, PPLink
from pdserve.runtime.rank.process import RankParts
from pdserve.runtime.rank.slot_loop import SlotLoop
from pdserve.runtime.reasons import AbortReason, describe


def vote_transport(comm: PPLink | None, num_slots: int) -> RingTransport:
    """The consensus ring (votes, leader sync) over the PP group, as VOTE-typed messages.

    Sends are committed `num_slots + 1` turns later: PP0 takes the last rank's verdict when it
    harvests the slot (up to L - 1 turns after it was sent), and a gloo send completes only then.
    """
    if comm is None:
        return InMemoryRing(1).transport(0)
    return PPGroupTransport(
        comm.rank,
        comm.size,
        send_obj=lambda dst, data: comm.send_obj(dst, data, Msg.VOTE, commit_after=num_slots + 1),
        recv_obj=lambda src, _timeout: comm.recv(src, Msg.VOTE),
    )


def pack_aux(token: int, logprob: float | None, top: list | None) -> bytes:
    return msgpack.packb([int(token), logprob, [list(p) for p in top] if top else None])


def unpack_aux(data: bytes) -> tuple[int, float | None, list[tuple[int, float]] | None]:
    tok, lp, top = msgpack.unpackb(data, raw=False)
    if not isinstance(tok, int):
        raise ValueError("aux data without a token id")
    return tok, lp, [(int(i), float(v)) for i, v in top] if top else None


@dataclass(eq=False)
class PDReq:
    """One disaggregated request on one rank: its engine request, its room and its transfer end."""

    rid: str
    room: int
    req: Req
    transfer: BaseKVSender | BaseKVReceiver  # this rank's end of the room's transfer
    sent_upto: int = 0  # prefill: tokens whose KV was handed to the sender
    pages: list[int] = field(default_factory=list)  # decode: preallocated pages
    # decode, on a windowed pool: the sliding pages the transfer writes (engine/window_pages.py)
    sliding: list[int] = field(default_factory=list)
    aux_slot: int | None = None  # decode: where the first token lands
    held: Any = None  # decode: the cached prompt prefix it holds (decode_node/prefix.py)
    aborted: bool = False
    reason: AbortReason | None = None  # set with `aborted`: why


# why a rank ends its own transfer end of a room that failed on another rank (an "aborted" reason:
# logged at debug level, like every abort)
FAILED_ELSEWHERE = "aborted:failed_elsewhere"

# the span each timed queue is traced as (docs/TRACING.md); a queue not named here is not a span
QUEUE_SPANS = {
    "bootstrap": "bootstrap",
    "inflight": "release_vote",
    "prealloc": "prealloc",
    "transfer": "transferred_vote",
}


class PDLoop(SlotLoop):
    """The slot loop of a PD rank: a PD request (`PDAddRequest`) opens a room with this rank's end
    of the transfer, and waits in the subclass's own queues around the engine's scheduler."""

    first_queue = ""  # the queue a new request enters (its timer and span start with it)
    role = ""  # "prefill" or "decode"
    vote_kinds: tuple[str, ...] = ()  # the kinds of its ring vote

    def __init__(self, parts: RankParts, kv_mgr: BaseKVManager, vote: RingVote | None = None):
        super().__init__(parts.loop_cfg, parts.comm, parts.runner, parts.sched, parts.front)
        self.kv_mgr = kv_mgr  # this rank's KV manager: the sender/receiver factory and its stats
        # An elastic node's loops of both roles share one vote (its messages in flight outlive a
        # flip, elastic_node/loop.py); a fixed node's loop makes its own.
        self.vote = vote or RingVote(
            vote_transport(parts.comm, parts.loop_cfg.num_slots),
            parts.loop_cfg.num_slots,
            kinds=self.vote_kinds,
        )
        # Told to become another role (SetRole): it admits no new request and drains; the flip
        # itself is the elastic rank's (elastic_node/loop.py). None: it serves its role.
        self.leaving_for: str | None = None
        # False: the KV manager (and store) outlive the loop: an elastic rank keeps them
        self.owns_transfer = True
        self.by_rid: dict[str, PDReq] = {}  # requests in this loop's own queues
        # they count as the node's requests for the fair prefill cap (engine/scheduler.py)
        self.sched.held_elsewhere = lambda: [pd.req.share for pd in self.by_rid.values()]
        self._t_stage: dict[str, float] = {}  # metrics only: when the request entered its queue
        self._t_cast: dict[int, float] = {}  # metrics only: slot -> when its votes were cast
        self._kv_latencies_seen = 0  # transfers whose latency a stats push carried already

    def open_room(self, msg: PDAddRequest, params: SamplingParams) -> PDReq:
        """The subclass's record of a new PD request, its transfer end created, queued."""
        raise NotImplementedError

    def apply_message(self, msg: Any) -> bool:
        if isinstance(msg, SetRole):
            self._set_role(msg.role)
            return True
        if self.leaving_for is not None and isinstance(msg, AddRequest):
            # every rank refuses it at the same place in the meta stream; PP0 answers
            why = AbortReason.ROLE_CHANGE
            self.emit(ErrorEvent(msg.rid, describe(why), None, why))
            return True
        if not isinstance(msg, PDAddRequest):
            return super().apply_message(msg)
        self.spans.trace(msg.rid, msg.traceparent)
        params = self._admissible(msg)
        if params is not None:
            self._stage_start(msg.rid, self.first_queue)  # before open_room's child spans
            self.by_rid[msg.rid] = pd = self.open_room(msg, params)
            hold_for_guide(pd.req, self.sched, self.runner.grammar)
        else:
            self.spans.finish(msg.rid, AbortReason.INVALID_REQUEST)
        return True

    @rank_consensus("pd_set_role", args=lambda self, role: [self.role, role])
    def _set_role(self, role: str) -> None:
        """Leave this role for `role` (the same role again: stay, a drain under way stops)."""
        self.leaving_for = None if role == self.role else role

    def drained(self) -> bool:
        """Nothing of this role is left on this rank: no request in any queue, none held, no batch
        with entries unharvested. A pure function of replicated state: the same on every rank."""
        return (
            not self.by_rid
            and not self.sched.reqs
            and not self.sched.kept_kv
            and not any(b is not None and b.entries for b in self.batches)
        )

    def _admissible(self, msg: PDAddRequest) -> SamplingParams | None:
        """Validates a PD request the same way on every rank; PP0 reports a rejection."""
        try:
            sp = SamplingParams.from_dict(msg.params)
            self.sched.check_admissible(len(msg.input_ids), sp)
            if msg.rid in self.by_rid or msg.rid in self.sched.reqs:
                raise ParamError("rid", f"duplicate request id {msg.rid!r}")
            return sp
        except ParamError as e:
            self.emit(ErrorEvent(msg.rid, str(e), e.field, AbortReason.INVALID_REQUEST))
            return None

    # --- what the ranks of a TP group observe, agreed before the votes (tp_group.py) -------------
    def stage_ballots(
        self,
        observed: dict[str, tuple[dict[int, KVPoll], list[int]]],
        quiet: dict[int, bool] | None = None,
    ) -> tuple[dict[str, Ballot], frozenset[int]]:
        """This rank's ballot of each vote kind (from its transfer ends' statuses and the aborted
        rooms) and the rooms of `quiet` whose flag is set; in a TP group, its stage's, agreed in
        one collective. Each rank of a group has its own end of every room's transfer, so a room
        is good where it is good on every rank of the group, and bad where it failed on one once
        it is final on all (the ring's own rule, vote.py, applied inside the group first); a
        `quiet` flag holds where it holds on every rank. The rooms are the same on every rank of
        the group (the queues are replicated), so whether the collective runs is too."""
        mine = {k: Ballot.from_statuses(k, st, ab) for k, (st, ab) in observed.items()}
        quiet = quiet or {}
        rows = [(k, r) for k, (st, _) in observed.items() for r in sorted(st)]
        if self.tp is None or not (rows or quiet):
            return mine, frozenset(r for r, q in quiet.items() if q)
        good = [int(r in mine[k].good) for k, r in rows]
        bad = [int(r in mine[k].bad) for k, r in rows]
        final = [g | b for g, b in zip(good, bad, strict=True)]
        rooms = sorted(quiet)
        n = len(rows)
        lo, hi = self.tp.min_max(good + final + [int(quiet[r]) for r in rooms] + bad)
        agreed = {k: (set(), set()) for k in observed}
        for i, (k, r) in enumerate(rows):
            if lo[i]:
                agreed[k][0].add(r)
            elif lo[n + i] and hi[2 * n + len(rooms) + i]:
                agreed[k][1].add(r)
        ballots = {
            k: Ballot(frozenset(g), frozenset(b), frozenset(observed[k][1]))
            for k, (g, b) in agreed.items()
        }
        held = lo[2 * n : 2 * n + len(rooms)]
        return ballots, frozenset(r for r, q in zip(rooms, held, strict=True) if q)

    def stage_polls(self, polls: list[KVPoll]) -> list[KVPoll]:
        """The statuses of this rank's transfer ends, or in a TP group the MIN over it (the
        slowest rank's progress; one Failed fails the room)."""
        if self.tp is None or not polls:
            return polls
        lo, _ = self.tp.min_max([int(p) for p in polls])
        return [KVPoll(x) for x in lo]

    def waiting_ends(self) -> list[BaseKVSender | BaseKVReceiver]:
        """The transfer ends of this rank's rooms (the decode loop adds its quarantine)."""
        return [pd.transfer for pd in self.by_rid.values()]

    def outstanding(self) -> Hashable | None:
        """The queue sizes and each room's transfer status: a room moves when its KV lands or fails
        (the votes act on that over the next turns) or when it changes queue."""
        ends = self.waiting_ends()
        if not ends:
            return None
        return tuple(sorted(self.queue_sizes().items())), tuple(int(e.poll()) for e in ends)

    def stats_extension(self) -> KVRankStats:
        """The transfer counters since start, and the rooms' latencies since the last push."""
        kv = self.kv_mgr.stats.snapshot()
        new = kv["latency_count"] - self._kv_latencies_seen
        self._kv_latencies_seen = kv["latency_count"]
        return KVRankStats(
            bytes=kv["bytes_sent"] + kv["bytes_received"],
            failures=dict(kv["failures"]),
            latencies=[lat for _, lat in kv["recent_latencies"][-new:]] if new > 0 else [],
            dropped=dict(kv["dropped"]),
            ctrl_port=getattr(self.kv_mgr, "ctrl_port", None),
            room_bytes=kv["recent_room_bytes"][-new:] if new > 0 else [],
            tokens=kv["tokens"],
            skipped_tokens=kv["skipped_tokens"],
            skipped_bytes=kv["skipped_bytes"],
            window_skipped_bytes=kv["window_skipped_bytes"],
            role=self.role,
            leaving=self.leaving_for is not None,
        )

    def describe(self) -> str:
        engine = self.kv_mgr.engine
        return f"KV transfer over {engine.protocol}, session {engine.session_id}"

    def _stage_start(self, rid: str, queue: str, now: float | None = None) -> None:
        """`rid` entered `queue`: its timer (metrics) and, when traced, its span start."""
        self._t_stage[rid] = time.monotonic() if now is None else now
        if queue in QUEUE_SPANS and self.spans.on(rid):
            self.spans.start(rid, QUEUE_SPANS[queue])

    def _stage_done(self, rid: str, queue: str, next_queue: str | None = None) -> float | None:
        """Observes the time `rid` spent in `queue` (metrics only; traced: its span ends);
        returns it, if it was timed."""
        if self.spans.on(rid):
            self.spans.end(rid, QUEUE_SPANS.get(queue, queue))
        t0 = self._t_stage.pop(rid, None)
        if t0 is None:
            return None
        now = time.monotonic()
        self.observe(f"queue:{queue}", now - t0)
        if next_queue:
            self._stage_start(rid, next_queue, now)
        return now - t0

    def _abort(self, pd: PDReq, why: AbortReason) -> None:
        """Marks `pd` aborted and fails its transfer end (the peers hear of it)."""
        pd.aborted, pd.reason = True, why
        pd.transfer.abort(f"aborted:{why}")

    def _end(self, pd: PDReq, reason: AbortReason, message: str | None = None) -> None:
        """The request failed or was aborted here: PP0 tells the front (`message`, else the
        reason's sentence), every rank forgets it."""
        self.emit(ErrorEvent(pd.rid, message or describe(reason), None, reason))
        self.spans.finish(pd.rid, str(reason))
        self._forget(pd)

    def _forget(self, pd: PDReq) -> None:
        self.by_rid.pop(pd.rid, None)
        self._t_stage.pop(pd.rid, None)

    def close_transfer(self) -> None:
        """Closes what this role owns beyond the engine: its KV manager."""
        self.kv_mgr.close()

    def close(self) -> None:
        super().close()
        if self.owns_transfer:
            self.close_transfer()
