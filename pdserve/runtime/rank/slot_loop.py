"""The slot loop: one iteration of docs/ARCHITECTURE.md section 3 on one PP rank.

    L = pp_size + async_depth slots; iteration t works on `slot` = t % L, harvests (t+1) % L

    ingest meta    PP0 pulls the front's messages (non-blocking), every other rank receives
                   PP0's list from its predecessor; forwarded unchanged down the chain, even empty
    apply meta     new requests and aborts, in list order, before scheduling (all ranks, same slot)
    schedule       the same deterministic scheduler on every rank => the same batch for `slot`
    forward        hidden states in from rank k-1, out to rank k+1, only for a non-empty batch;
                   the last rank samples and queues the outputs, sent `async_depth` turns later
    ring+harvest   the sampled outputs of slot (t+1) % L go last -> PP0 -> PP1 -> ...; every rank
                   applies them to its requests, so slot (t+1) % L is up to date before it is reused

A batch with no sampling entries (empty, or pure intermediate prefill chunks when
`skip_pure_chunk_comm` is on) has no ring message, unless a request waits for its guide's compile
(the message carries the report, engine/guide_hold.py): every rank knows from its own schedule."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from pdserve.consensus import rank_checker
from pdserve.consensus.rank_checker import RankDivergence as RankDivergence  # tests import it here
from pdserve.engine.batch import SampleOut, ScheduledBatch
from pdserve.engine.core import ParamError, Req, SamplingParams
from pdserve.engine.grammar import compiled_guides, hold_for_guide
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.runtime.messages import (
    AbortRequest,
    AbortUnknownEvent,
    AddRequest,
    ErrorEvent,
    Event,
    FinishEvent,
    StatsExtension,
    TokenEvent,
    decode,
    encode,
    out_from_wire,
    out_to_wire,
    ring_from_wire,
    ring_to_wire,
)
from pdserve.runtime.rank.idle_wait import IdleWait
from pdserve.runtime.rank.loop_samples import LoopSamples
from pdserve.runtime.rank.pp_comm import Msg, PPLink
from pdserve.runtime.rank.rank_loop import FrontIO, LoopStats
from pdserve.runtime.rank.rank_loop import RankLoop as RankLoop  # re-export: front_link.py
from pdserve.runtime.rank.request_timeouts import RequestTimeouts
from pdserve.runtime.rank.spans import RankSpans, now_ns
from pdserve.runtime.reasons import AbortReason, finish_message

log = logging.getLogger(__name__)


@dataclass
class LoopConfig:
    pp_size: int = 1
    async_depth: int = 0
    skip_pure_chunk_comm: bool = True
    # PP0's wait for the front when it has nothing to schedule (runtime/rank/idle_wait.py): from
    # idle_wait_ms, doubling up to idle_max_wait_ms with nothing at all to do, or up to
    # outstanding_max_wait_ms while only outstanding work (PD rooms) waits and does not move.
    idle_wait_ms: int = 5
    idle_max_wait_ms: int = 250
    outstanding_max_wait_ms: int = 20
    check_every: int = 8  # consensus-checker digest comparison period (iterations)
    waiting_timeout_s: float = 0.0  # PP0 aborts a request queued longer than this (0 = off)
    running_timeout_s: float = 0.0  # PP0 aborts a request alive longer than this (0 = off)

    @property
    def num_slots(self) -> int:
        return self.pp_size + self.async_depth


class SlotLoop(LoopSamples):
    """One rank's loop. A PD loop extends it by subclassing: the hooks below (`apply_message` for
    its own message kinds, the queue steps around the iteration, its own stats) are the one way in.
    """

    def __init__(
        self,
        cfg: LoopConfig,
        comm: PPLink | None,
        runner: ModelRunner,
        scheduler: Scheduler,
        front: FrontIO | None,
    ):
        super().__init__()
        self.cfg = cfg
        self.comm = comm
        self.rank = comm.rank if comm else 0
        self.size = cfg.pp_size
        self.runner = runner
        self.sched = scheduler
        self.front = front  # PP0 only
        self.batches: list[ScheduledBatch | None] = [None] * cfg.num_slots  # not harvested yet
        # last rank: slot -> (outputs, [(rid, bytes)] whose guides compiled), the ring's queue
        self.last_outputs: dict[int, tuple[SampleOut | None, list[tuple[str, int]]]] = {}
        self.send_queue: deque[tuple[int, SampleOut | None, list[tuple[str, int]]]] = deque()
        self.stats = LoopStats()
        self.stop = threading.Event()
        self._events: list[Event] = []  # PP0: what to tell the front this iteration
        self._timeouts = RequestTimeouts(cfg.waiting_timeout_s, cfg.running_timeout_s)  # PP0
        self.stream_tokens = True  # the prefill loop answers with its own events
        self.spans = RankSpans()  # traced requests' stages (side data, docs/TRACING.md)
        # the TP group of this rank's stage (runtime/rank/tp_group.py), where it has one
        self.tp = comm.tp if comm is not None else None
        self._idle = IdleWait(cfg.idle_wait_ms, cfg.idle_max_wait_ms, cfg.outstanding_max_wait_ms)

    @property
    def _pp(self) -> PPLink:
        """The PP link, for the code that runs only where there is one (every rank of a pipeline
        of pp_size > 1 has it; a lone rank may not)."""
        assert self.comm is not None, "this rank has no PP link"
        return self.comm

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    # --- one iteration ----------------------------------------------------------------------------
    def iteration(self, t: int) -> None:
        slot = t % self.cfg.num_slots
        if self.comm:
            self.comm.commit()
        meta = self.ingest_meta()
        self.apply_meta(meta)
        self.before_schedule(t, slot)
        if self.size == 1 and self.sched.guides_pending:  # a lone rank samples: no ring to wait
            self.sched.guides_compiled(self.compiled_guides())
        batch = self.sched.schedule(slot)
        self.batches[slot] = batch
        self.time_admissions(batch)
        hidden_or_logits = self.forward(batch)
        self.after_forward(batch)
        self.exchange_and_harvest(t, slot, batch, hidden_or_logits)
        self.after_harvest(t, (t + 1) % self.cfg.num_slots)
        self.report()
        self.stats.iterations += 1
        self.stats.last_progress = time.monotonic()
        if rank_consensus_enabled() and self.comm and t % self.cfg.check_every == 0:
            self.check_consensus(t)

    # --- hooks for the PD loops (prefill_node/, decode_node/): queue steps around the iteration
    def before_schedule(self, t: int, slot: int) -> None:
        """Runs on every rank after the meta was applied and before `slot` is scheduled."""

    def after_forward(self, batch: ScheduledBatch) -> None:
        """Runs on every rank after this rank's forward of `batch` (its KV pages are written)."""

    def after_harvest(self, t: int, harvest_slot: int) -> None:
        """Runs on every rank once `harvest_slot` was harvested (or had nothing to harvest)."""

    def on_finished(self, req: Req) -> None:
        """Runs on every rank for each request the scheduler finished this iteration."""
        self.spans.finish(req.rid, req.finish.kind if req.finish else "unknown")

    def outstanding(self) -> Hashable | None:
        """Work that waits on something outside the scheduler (PD loops: rooms in bootstrap,
        transfer, release votes, quarantine), as a value that changes whenever that work moves;
        None: there is none. PP0 polls faster while it moves (runtime/rank/idle_wait.py). Timing
        only: no decision reads it."""
        return None

    def request_phase(self, rid: str) -> str | None:
        """ "waiting" (queued, no forward yet), "running", or None (not known here); for timeouts.
        The PD loops add their own queues: a request waiting for its KV bootstrap or transfer
        is waiting too."""
        req = self.sched.reqs.get(rid)
        if req is None:
            return None
        return "waiting" if req.status.value == "waiting" else "running"

    def _idle_wait_ms(self) -> int:
        busy = self.sched.has_work or any(b is not None and b.entries for b in self.batches)
        outstanding = None if busy else self.outstanding()
        if (
            not busy and self.sched.guides_pending
        ):  # held until their compile: polled as outstanding
            outstanding = (outstanding, self.sched.guides_pending)
        return self._idle.next(busy, outstanding)

    def ingest_meta(self) -> list[Any]:
        if self.is_first:
            meta = self.front.poll(self._idle_wait_ms()) if self.front else []
            if meta:
                self._idle.woken()
            meta.extend(self.timeout_aborts(meta))
            if self.tp is not None:  # the TP group's other ranks take PP0 TP0's meta
                meta = self.tp.same_meta(meta)
        else:
            # PP0 decoded and checked every message; a failure here is a bug, and it stops the rank.
            meta = [decode(m) for m in self._pp.recv(self._pp.prev, Msg.META)]
        if self.comm and not self.is_last:
            self.comm.send_obj(self.comm.next, [encode(m) for m in meta], Msg.META)
        return meta

    def timeout_aborts(self, incoming: list[Any]) -> list[AbortRequest]:
        """PP0 only: wall-clock timeouts become abort messages in the meta stream
        (docs/ARCHITECTURE.md section 7; runtime/rank/request_timeouts.py)."""
        return self._timeouts.aborts(incoming, self.request_phase)

    def apply_meta(self, meta: list[Any]) -> None:
        for msg in meta:
            if isinstance(msg, AbortRequest):
                req = self.sched.abort(msg.rid, msg.reason)
                if req is None and not self.abort_elsewhere(msg.rid, msg.reason):
                    self.emit(AbortUnknownEvent(msg.rid))
            elif not self.apply_message(msg):
                log.warning("message %s dropped: this loop does not take it", type(msg).__name__)

    def apply_message(self, msg: Any) -> bool:
        """Applies a request message on every rank; False if this loop does not take its kind.
        A PD loop takes its own kinds here and leaves the rest to this one."""
        if type(msg) is not AddRequest:
            return False
        self.spans.trace(msg.rid, msg.traceparent)
        try:
            params = SamplingParams.from_dict(msg.params)
            req = Req(
                msg.rid, list(msg.input_ids), params, output_ids=[*msg.output_ids], share=msg.share
            )
            self.sched.add(req)
            self.mark_queued(msg.rid)
            self.spans.start(msg.rid, "waiting")
            hold_for_guide(req, self.sched, self.runner.grammar)
        except ParamError as e:  # every rank rejects it the same way; PP0 answers
            self.emit(ErrorEvent(msg.rid, str(e), e.field, AbortReason.INVALID_REQUEST))
            self.spans.finish(msg.rid, AbortReason.INVALID_REQUEST)
        return True

    def stats_extension(self) -> StatsExtension | None:
        """What this kind of loop adds to its rank's stats push (a PD loop: its KV transfer
        counters); called once per push."""
        return None

    def describe(self) -> str:
        """What the rank's ready line adds (a PD loop: its KV transfer engine)."""
        return ""

    def queue_sizes(self) -> dict[str, int]:
        """Requests per queue, for stats and metrics; a PD loop adds its own queues."""
        s = self.sched
        retracted = sum(r.status.value == "retracted" for r in s.waiting)
        return {"waiting": len(s.waiting), "running": s.num_running, "retracted": retracted}

    def abort_elsewhere(self, rid: str, why: str) -> bool:
        """A PD loop aborts a request that sits in one of its own queues; True if it knew it."""
        return False

    def emit(self, event: Event) -> None:
        """PP0 tells the front (every rank may call it; only PP0's events leave)."""
        if self.is_first:
            self._events.append(event)

    def forward(self, batch: ScheduledBatch) -> Any:
        y = out = None
        if batch.entries:
            t0 = now_ns() if self.spans.active else 0
            hidden_in = self._pp.recv(self._pp.prev, Msg.HIDDEN) if not self.is_first else None
            y = self.runner.forward(batch, hidden_in)
            if t0:
                self.spans.prompt_chunks(batch.entries, t0, now_ns())
            self.stats.forwards += 1
            if self.is_last and batch.sampling_entries:
                out = self._sample(batch, y)
        if self.is_last:  # the outputs, and a pipeline's report of compiled guides, go round
            report = batch.awaits_guides and self.size > 1  # a lone rank's is taken in `iteration`
            ready = self.compiled_guides() if report else []
            self.last_outputs[batch.slot] = (out, ready)
            self.send_queue.append((batch.slot, out, ready))
        return y

    def _needs_ring(self, batch: ScheduledBatch | None) -> bool:
        if batch is None:
            return False
        if batch.awaits_guides and self.size > 1:  # the ring carries the compiled guides' notice
            return True
        if not batch.entries:
            return False
        return not (batch.is_pure_chunk and self.cfg.skip_pure_chunk_comm)

    def exchange_and_harvest(self, t: int, slot: int, batch: ScheduledBatch, y: Any) -> None:
        harvest_slot = (t + 1) % self.cfg.num_slots
        harvest_batch = self.batches[harvest_slot] if t + 1 >= self.cfg.num_slots else None
        send_hidden = (
            (lambda: self._pp.send_tensor(self._pp.next, y, Msg.HIDDEN))
            if (self.comm and not self.is_last and batch.entries)
            else None
        )
        recv_ring = None
        if self.size > 1 and not self.is_last and self._needs_ring(harvest_batch):
            src = self.size - 1 if self.is_first else self._pp.prev
            recv_ring = lambda: self._pp.recv(src, Msg.OUTPUT)  # noqa: E731
        wire = None
        # Even ranks send-then-receive, odd ranks receive-then-send: no cycle of blocking sends.
        if self.rank % 2 == 0:
            if send_hidden:
                send_hidden()
            if recv_ring:
                wire = recv_ring()
        else:
            if recv_ring:
                wire = recv_ring()
            if send_hidden:
                send_hidden()
        if self.is_last and self.size > 1:
            while len(self.send_queue) > self.cfg.async_depth:
                sent, out, ready = self.send_queue.popleft()
                if self._needs_ring(self.batches[sent]):
                    wire_out = ring_to_wire(out, ready)
                    self._pp.send_obj(0, wire_out, Msg.OUTPUT, commit_after=self.size)
        elif self.is_last:
            self.send_queue.clear()
        if recv_ring and self.rank + 1 < self.size - 1:
            self._pp.send_obj(self._pp.next, wire, Msg.OUTPUT)
        if harvest_batch is not None:
            last = self.last_outputs.pop(harvest_slot, (None, [])) if self.is_last else None
            out, ready = last or ring_from_wire(wire)
            if ready:
                self.sched.guides_compiled(ready)
            self.harvest(harvest_batch, out)
            self.batches[harvest_slot] = None

    def harvest(self, batch: ScheduledBatch, out: SampleOut | None) -> None:
        got = self.sched.harvest(batch, out)
        if self.is_first and self.stream_tokens:
            for req in got:
                lp = req.output_logprobs[-1] if req.params.logprobs else None
                top = req.output_top_logprobs[-1] if req.params.top_logprobs else None
                self._events.append(TokenEvent(req.rid, req.output_ids[-1], lp, top))

    def compiled_guides(self) -> list[tuple[str, int]]:
        """The sampling rank's report of compiled guides (engine/guide_hold.py); in a TP group
        its lead's, the one rank that compiles them (it alone samples: `_sample`)."""
        ready = compiled_guides(self.sched.reqs, self.runner.grammar)
        return self.tp.same(Msg.GUIDES, ready) if self.tp is not None else ready

    def _sample(self, batch: ScheduledBatch, logits: Any) -> SampleOut:
        """The last stage's tokens. In a TP group only the lead samples, and its followers take
        its tokens: a sampling sum over the vocabulary splits by thread count, so two ranks'
        own samples could differ in a bit, and in a token."""
        if self.tp is None or self.tp.is_lead:
            out = self.runner.sample(batch, logits)
            if self.tp is not None:
                self.tp.share(Msg.SAMPLE, out_to_wire(out))
            return out
        return out_from_wire(self.tp.take(Msg.SAMPLE))

    def report(self) -> None:
        for req in self.sched.drain_finished():
            self.time_finish(req)
            self.on_finished(req)
            if self.is_first and self.stream_tokens:
                f = req.finish
                assert f is not None  # drain_finished gives finished requests only
                msg, code = finish_message(f)
                n, cached = req.prompt_len, req.cached_len
                out = len(req.output_ids)
                self._events.append(
                    FinishEvent(req.rid, f.kind, msg, f.matched, n, out, cached, code)
                )
        if self.is_first and self._events and self.front:
            self.front.report(self._events)
        self._events = []

    def close(self) -> None:
        """Releases what the loop owns: the sampling rank's grammar compile thread (a PD loop
        also closes its KV manager and store)."""
        if self.runner.grammar is not None:
            self.runner.grammar.close()

    def check_consensus(self, t: int) -> None:
        rank_checker.compare_across_ranks(self._pp, t)


def rank_consensus_enabled() -> bool:
    return rank_checker.ENABLED
