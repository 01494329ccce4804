"""The prefill node's slot loop: bootstrap, waiting, running (chunked prefill), inflight, released.

Added around the engine's slot loop (runtime/rank/slot_loop.py), on every rank:

  PDAddRequest     a sender for the room is created; the request joins the `bootstrap` queue
  bootstrap        each rank writes its sender's status into the PPConsensusStore; PP0 reads
                   min over ranks for the queue, in order, and sends its list down the chain
                   (leader sync); every rank moves the same requests in the same iteration:
                   WaitingForInput => the scheduler's waiting queue, Failed => error to the router
  after forward    each rank hands the chunk's pages (its own layers) to its sender
  harvest          the sampled first token is the aux data, sent after the last chunk; the
                   request's pages stay held (`inflight`) while the KV is on the wire
  release vote     two-pass ring vote over terminal transfer states (Success or Failed); the
                   verdict frees the pages on every rank in the same iteration and answers PP0's
                   front: done, or failed with the reason

An abort marks the sender Failed wherever the request is; the store (bootstrap) or the vote
(inflight) turns that into the same decision on every rank, and pages are only freed by the vote,
once no transfer thread reads them any more.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pdserve.consensus.kvpoll import KVPoll, done_for
from pdserve.consensus.leader_sync import LeaderSync
from pdserve.consensus.rank_checker import rank_consensus
from pdserve.consensus.store import PPConsensusStore
from pdserve.consensus.vote import RELEASE, RingVote
from pdserve.engine.batch import ScheduledBatch
from pdserve.engine.core import Req, SamplingParams
from pdserve.kv_transfer.base import BasePrefillKVManager
from pdserve.pd_common.loop_base import FAILED_ELSEWHERE, PDLoop, PDReq, pack_aux
from pdserve.pd_common.messages import PDAddRequest, PrefillDoneEvent
from pdserve.runtime.rank.pp_comm import Msg
from pdserve.runtime.rank.process import RankParts
from pdserve.runtime.reasons import AbortReason, as_reason

log = logging.getLogger("pdserve.prefill")


class PrefillLoop(PDLoop):
    first_queue = "bootstrap"
    role = "prefill"
    vote_kinds = (RELEASE,)
    sample_names = (
        "queue:bootstrap",
        "queue:waiting",
        "queue:running",
        "queue:inflight",
        "bootstrap",
        "consensus:bootstrap_sync",
        "consensus:prefill_release",
    )

    def __init__(
        self,
        parts: RankParts,
        kv_mgr: BasePrefillKVManager,
        store: PPConsensusStore | None,
        vote: RingVote | None = None,
    ):
        super().__init__(parts, kv_mgr, vote)
        self.spans.role = "prefill"
        self.stream_tokens = False  # the front hears PrefillDoneEvent or ErrorEvent only
        self.store = store
        self.sync = LeaderSync(self.vote.t) if parts.comm else None
        self.bootstrap: list[PDReq] = []  # queue order is arrival order, the same on every rank
        self.inflight: dict[int, PDReq] = {}  # room -> request whose KV is on the wire

    def queue_sizes(self) -> dict[str, int]:
        return {
            **super().queue_sizes(),
            "bootstrap": len(self.bootstrap),
            "inflight": len(self.inflight),
        }

    def request_phase(self, rid: str) -> str | None:
        pd = self.by_rid.get(rid)
        if pd is None or rid in self.sched.reqs:
            return super().request_phase(rid)
        return "running" if pd.room in self.inflight else "waiting"  # else still bootstrapping

    # --- a new request ----------------------------------------------------------------------------
    def open_room(self, msg: PDAddRequest, params: SamplingParams) -> PDReq:
        # The prefill side samples the first token only; the decode side continues the same params.
        # A migrated stream's tokens (`output_ids`) are prefilled after the prompt, and the token
        # after them is the one sampled here.
        first = replace(params, max_tokens=len(msg.output_ids) + 1, stop=())
        req = Req(
            msg.rid, list(msg.input_ids), first, output_ids=list(msg.output_ids), share=msg.share
        )
        pd = PDReq(msg.rid, msg.room, req, self.kv_mgr.create_sender(msg.room))
        self.bootstrap.append(pd)
        self.spans.start(msg.rid, "bootstrap.wait_decode_alloc", parent="bootstrap")
        return pd

    def _bootstrap_done(self, rid: str) -> None:
        if self.spans.on(rid):  # the children end with their parent
            self.spans.end(rid, "bootstrap.wait_decode_alloc")
            self.spans.end(rid, "bootstrap.handshake")
        waited = self._stage_done(rid, "bootstrap")
        if waited is not None:
            self.observe("bootstrap", waited)

    def abort_elsewhere(self, rid: str, why: str) -> bool:
        pd = self.by_rid.get(rid)
        if pd is None:
            return False
        self._abort(pd, as_reason(why))
        return True

    # --- bootstrap (PPConsensusStore + leader sync) -----------------------------------------------
    def before_schedule(self, t: int, slot: int) -> None:
        if self.bootstrap:
            self._bootstrap_step()
        statuses = {room: pd.transfer.poll() for room, pd in self.inflight.items()}
        aborted = [room for room, pd in self.inflight.items() if pd.aborted]
        if self.inflight and self.is_first:
            self._t_cast[slot] = time.monotonic()
        ballots, _ = self.stage_ballots({RELEASE: (statuses, aborted)})
        self.vote.pass1(slot, ballots)

    def _bootstrap_step(self) -> None:
        t0 = time.monotonic()
        local = [pd.transfer.poll() for pd in self.bootstrap]
        if self.spans.active:
            self._trace_registered(local)
        local = self.stage_polls(local)  # a TP group's MIN, before the store
        if self.sync is None or self.size == 1:
            self._apply_bootstrap(local)
            return
        if self.store is not None:  # a stage's lead (a TP follower has no store)
            for pd, st in zip(self.bootstrap, local, strict=True):
                self.store.update_status(pd.room, st)
        polls = None
        if self.is_first:
            rooms = [pd.room for pd in self.bootstrap]
            polls = self.store.statuses(rooms) if self.store is not None else None
            if self.tp is not None:  # PP0's followers take their lead's reading
                polls = [KVPoll(p) for p in self.tp.same(Msg.SYNC, polls and list(map(int, polls)))]
        polls = self.sync.sync_polls(polls)
        self.observe("consensus:bootstrap_sync", time.monotonic() - t0)
        self._apply_bootstrap(polls)

    @rank_consensus(
        "pd_bootstrap",
        args=lambda self, polls: [[pd.room for pd in self.bootstrap], [int(p) for p in polls]],
    )
    def _apply_bootstrap(self, polls: list[KVPoll]) -> None:
        keep = []
        for pd, st in zip(self.bootstrap, polls, strict=True):
            if st == KVPoll.Failed:
                self._bootstrap_done(pd.rid)
                why = pd.transfer.reason or "decode side never registered"
                pd.transfer.abort(FAILED_ELSEWHERE)  # this rank's sender may still be waiting
                if pd.aborted:
                    self._end(pd, pd.reason)
                else:
                    self._end(pd, AbortReason.BOOTSTRAP_FAILED, f"bootstrap failed: {why}")
            elif st >= KVPoll.WaitingForInput:
                self._bootstrap_done(pd.rid)
                self.sched.add(pd.req)
                self.mark_queued(pd.rid)
                self.spans.start(pd.rid, "waiting")
            else:
                keep.append(pd)
        self.bootstrap = keep

    def _trace_registered(self, local: list[KVPoll]) -> None:
        """Traced requests whose sender has every decode registration: the wait for the decode
        side's allocation is over, the handshake (the ranks agreeing on it) goes on."""
        for pd, st in zip(self.bootstrap, local, strict=True):
            if st >= KVPoll.WaitingForInput and self.spans.is_open(
                pd.rid, "bootstrap.wait_decode_alloc"
            ):
                self.spans.end(pd.rid, "bootstrap.wait_decode_alloc")
                self.spans.start(pd.rid, "bootstrap.handshake", parent="bootstrap")

    # --- chunks -----------------------------------------------------------------------------------
    def after_forward(self, batch: ScheduledBatch) -> None:
        for e in batch.entries:
            pd = self.by_rid.get(e.req.rid)
            if pd is not None and not pd.aborted:
                end = e.start + e.num_new
                # seq_len: every token this prefill computes (nothing is sampled before the last)
                total = e.req.seq_len
                pd.transfer.send_chunk(e.pages, pd.sent_upto, end, last=False, total_tokens=total)
                pd.sent_upto = end

    def on_finished(self, req: Req) -> None:
        pd = self.by_rid.get(req.rid)
        if pd is None:
            return
        if req.finish.kind == "abort":
            self._abort(pd, as_reason(req.finish.message))
            if pd.sent_upto == 0 and req.rid in self.sched.kept_kv:
                self.sched.release(req.rid)  # no transfer thread ever saw its pages
            if req.rid in self.sched.kept_kv:
                self.inflight[pd.room] = pd  # freed by the release vote, once no thread reads them
            else:
                self._end(pd, pd.reason)
            return
        lp = req.output_logprobs[-1] if req.output_logprobs else None
        top = req.output_top_logprobs[-1] if req.output_top_logprobs else None
        pd.transfer.send_chunk(
            req.pages,
            pd.sent_upto,
            req.kv_len,
            last=True,
            aux=pack_aux(req.output_ids[-1], lp, top),
            total_tokens=req.kv_len,
        )
        self.inflight[pd.room] = pd
        self._stage_start(pd.rid, "inflight")

    # --- release vote -----------------------------------------------------------------------------
    def after_harvest(self, t: int, harvest_slot: int) -> None:
        verdict = self.vote.pass2(harvest_slot)[RELEASE]
        t_cast = self._t_cast.pop(harvest_slot, None)
        if t_cast is not None:
            self.observe("consensus:prefill_release", time.monotonic() - t_cast)
        good, bad, _retry = verdict.partition(
            lambda room: (
                room in self.inflight and done_for(RELEASE, self.inflight[room].transfer.poll())
            ),
            RELEASE,
        )
        self._apply_release(good, bad)

    @rank_consensus("pd_release", args=lambda self, good, bad: [sorted(good), sorted(bad)])
    def _apply_release(self, good: frozenset, bad: frozenset) -> None:
        for room in sorted(good | bad):
            pd = self.inflight.pop(room)
            self._stage_done(pd.rid, "inflight")
            if self.spans.on(pd.rid):
                self._trace_transfer(pd)
            if pd.rid in self.sched.kept_kv:
                self.sched.release(pd.rid)
            if room in good and not pd.aborted:
                self.emit(PrefillDoneEvent(pd.rid, pd.req.prompt_len, pd.req.cached_len))
                self.spans.finish(pd.rid, "prefill_done")
                self._forget(pd)
            elif pd.aborted:
                self._end(pd, pd.reason)
            else:
                why = pd.transfer.reason or "a prefill rank failed"
                self._end(pd, AbortReason.KV_TRANSFER_FAILED, f"KV transfer failed: {why}")

    def _trace_transfer(self, pd: PDReq) -> None:
        """This rank's KV transfer of the room, from its sender's own times and counters."""
        s = pd.transfer
        t0, t1 = getattr(s, "first_chunk_at", None), getattr(s, "finished_at", None)
        if t0 is None or t1 is None:
            return
        self.spans.span(
            pd.rid,
            "kv_transfer",
            self.spans.wall_ns(t0),
            self.spans.wall_ns(t1),
            bytes=int(getattr(s, "bytes_sent", 0)),
            descriptors=int(getattr(s, "descriptors", 0)),
            status=s.poll().name,
        )

    def _forget(self, pd: PDReq) -> None:
        super()._forget(pd)
        if self.store is not None:
            self.store.pop(pd.room, None)

    def close_transfer(self) -> None:
        super().close_transfer()
        if self.store is not None:
            self.store.close()
