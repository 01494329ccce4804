"""The decode node's slot loop: prealloc -> transfer -> running (decode) -> finished (+ retracted).

Added around the engine's slot loop (runtime/rank/slot_loop.py), on every rank:

  PDAddRequest    a receiver for the room is created; the request joins the `prealloc` queue
  prealloc        first come first served, the same decision on every rank (same pool, same
                  history): the cached prefix of the prompt (decode_node/prefix.py), pages for the
                  rest and an aux slot, after the pages retracted requests need to resume; each
                  rank registers them with the prefill ranks that hold its layers, which send only
                  the pages after the prefix
  prealloc vote   good = registered (WaitingForInput or later), bad = Failed, aborted => bad;
                  admitted requests move to `transfer` on every rank in the same iteration
  transfer vote   good = Success (every prefill rank's KV and the aux data landed), bad = Failed;
                  the first token comes from the aux data and the request joins the running
                  batch of the slot being harvested, so it is decoded on every rank together
  running         the engine's scheduler; under KV pressure it retracts the youngest request of
                  the slot (deterministic) and re-prefills it from prompt + outputs later

A request whose KV did not fully arrive on every rank is never decoded: only the transfer vote's
good set reaches the scheduler. A failed room's pages are not reused while a prefill write could
still land in them: they wait in `quarantine` until the release vote finds the room quiesced on
every rank (each prefill peer sent its final word, or a grace period beyond the write timeout).
"""

from __future__ import annotations

import heapq
import logging
import time

from pdserve.consensus.kvpoll import done_for
from pdserve.consensus.rank_checker import rank_consensus
from pdserve.consensus.vote import PREALLOC, RELEASE, TRANSFERRED, Ballot, RingVote
from pdserve.decode_node.prefix import HeldPrefix, hold_prefix, release_prefix
from pdserve.engine.core import Req, SamplingParams
from pdserve.engine.kv_cache import pages_needed
from pdserve.kv_transfer.base import BaseDecodeKVManager, BaseKVReceiver
from pdserve.kv_transfer.layout import window_start
from pdserve.pd_common.loop_base import FAILED_ELSEWHERE, PDLoop, PDReq, unpack_aux
from pdserve.pd_common.messages import PDAddRequest
from pdserve.runtime.messages import TokenEvent
from pdserve.runtime.rank.process import RankParts
from pdserve.runtime.reasons import AbortReason, as_reason

log = logging.getLogger("pdserve.decode")


class DecodeLoop(PDLoop):
    first_queue = "prealloc"
    role = "decode"
    vote_kinds = (PREALLOC, TRANSFERRED, RELEASE)
    sample_names = (
        "queue:running",
        "queue:prealloc",
        "queue:transfer",
        "kv_alloc_wait",
        "consensus:decode_votes",
    )

    def __init__(
        self,
        parts: RankParts,
        kv_mgr: BaseDecodeKVManager,
        aux_slots: int,
        vote: RingVote | None = None,
    ):
        super().__init__(parts, kv_mgr, vote)
        self.spans.role = "decode"
        self._traced_status: dict[str, str] = {}  # decoding traced rid -> last status (traces)
        self.prealloc: list[PDReq] = []  # arrival order, the same on every rank
        self.transfer: dict[int, PDReq] = {}  # room -> admitted request whose KV is arriving
        # failed rooms whose pages a late write could still hit
        self.quarantine: dict[int, PDReq] = {}
        self.aux_free = list(range(aux_slots))  # a heap: lowest free slot first, like the pages
        if self.sched.window_pages is not None:  # rooms waiting for KV read the tree's pages too
            self.sched.window_pages.watch(self._rooms_holding_window)

    def _rooms_holding_window(self) -> list[tuple[Req, bool]]:
        """The rooms holding sliding pages: they will decode (WindowPages.watch)."""
        return [(pd.req, True) for pd in [*self.prealloc, *self.transfer.values()] if pd.pages]

    def drained(self) -> bool:
        return super().drained() and not self.quarantine

    def waiting_ends(self) -> list[BaseKVReceiver]:
        return [*super().waiting_ends(), *(pd.transfer for pd in self.quarantine.values())]

    def queue_sizes(self) -> dict[str, int]:
        return {
            **super().queue_sizes(),
            "prealloc": len(self.prealloc),
            "transfer": len(self.transfer),
            "quarantine": len(self.quarantine),
        }

    def request_phase(self, rid: str) -> str | None:
        # by_rid holds the requests in prealloc and transfer: no decode step yet, so waiting.
        return "waiting" if rid in self.by_rid else super().request_phase(rid)

    # --- a new request ----------------------------------------------------------------------------
    def open_room(self, msg: PDAddRequest, params: SamplingParams) -> PDReq:
        receiver = self.kv_mgr.create_receiver(msg.room, msg.bootstrap_addr)
        # a migrated stream's tokens (`output_ids`) arrive as KV after the prompt's
        req = Req(
            msg.rid, list(msg.input_ids), params, output_ids=list(msg.output_ids), share=msg.share
        )
        pd = PDReq(msg.rid, msg.room, req, receiver)
        self.prealloc.append(pd)
        self.spans.start(msg.rid, "first_token")
        return pd

    def abort_elsewhere(self, rid: str, why: str) -> bool:
        pd = self.by_rid.get(rid)
        if pd is None:
            return False
        self._abort(pd, as_reason(why))
        if not pd.pages:  # never registered: nothing can be written to it
            self.prealloc.remove(pd)
            self._end(pd, pd.reason)
        return True

    # --- prealloc and the votes -------------------------------------------------------------------
    def before_schedule(self, t: int, slot: int) -> None:
        self._preallocate()
        registered = [pd for pd in self.prealloc if pd.pages]
        if self.is_first and (registered or self.transfer or self.quarantine):
            self._t_cast[slot] = time.monotonic()
        grace = self.kv_mgr.config.quarantine_s
        ballots, quiet = self.stage_ballots(
            {
                PREALLOC: (
                    {pd.room: pd.transfer.poll() for pd in registered},
                    [pd.room for pd in registered if pd.aborted],
                ),
                TRANSFERRED: (
                    {r: pd.transfer.poll() for r, pd in self.transfer.items()},
                    [r for r, pd in self.transfer.items() if pd.aborted],
                ),
            },
            {r: pd.transfer.quiesced(grace) for r, pd in self.quarantine.items()},
        )
        self.vote.pass1(slot, {**ballots, RELEASE: Ballot(good=quiet)})

    @rank_consensus("pd_prealloc", result=lambda placed: placed)
    def _preallocate(self) -> list[tuple[int, int, list[int], int, list[int]]]:
        alloc, ps = self.sched.allocator, self.sched.cfg.page_size
        reserve = self.sched.num_running  # one page of decode headroom per running request
        # Retracted requests (the scheduler's waiting queue) come back before new rooms take pages:
        # prealloc runs first in every iteration, so without this it takes each freed page and a
        # retracted request starves for as long as new requests keep arriving.
        reserve += sum(pages_needed(r.seq_len, ps) for r in self.sched.waiting)
        placed = []
        for pd in self.prealloc:
            if pd.pages:
                continue
            if not self.aux_free:
                break  # first come first served
            held = self._hold_prefix(pd)  # locked first: the eviction below cannot take it
            need = pages_needed(pd.req.seq_len, ps) - len(held.pages)  # prompt + resumed tokens
            fits, sliding = self.sched.free_pages_for(need + reserve), None
            wp = self.sched.window_pages
            if fits and wp is not None:  # and the sliding layers' window (window_pages.py)
                waiting = len(self.sched.waiting) * wp.chunk_pages  # as `reserve` does above
                first = self._window_start(pd.req.seq_len) // ps  # where the transfer starts it
                sliding = wp.for_transfer(
                    pd.req, pd.req.seq_len, first, held.handle, len(held.pages), waiting
                )
                fits = sliding is not None
            if not fits:
                release_prefix(self.sched, held)
                break
            pd.held, pd.pages = held, alloc.alloc(need)
            pd.sliding = sliding[1] if sliding is not None else []
            pd.aux_slot = heapq.heappop(self.aux_free)
            if self.sched.cache is not None:
                self.sched.cache.hit_tokens_total += held.tokens
            if pd.rid in self._t_stage:  # metrics only: how long it waited for KV memory
                self.observe("kv_alloc_wait", time.monotonic() - self._t_stage[pd.rid])
            # a slice of full layers only allocates the same sliding pages but moves none there
            to = sliding if self.kv_mgr.sliding_pool is not None else None
            pd.transfer.register(pd.pages, pd.aux_slot, held.tokens, to)
            self.spans.event(pd.rid, "prealloc", "allocated")
            placed.append((pd.room, held.tokens, pd.pages, pd.aux_slot, pd.sliding))
        return placed

    @rank_consensus("pd_decode_prefix", args=lambda self, pd: pd.room, result=lambda h: h.tokens)
    def _hold_prefix(self, pd: PDReq) -> HeldPrefix:
        """The room's cached prompt prefix, locked: the same length on every rank."""
        return hold_prefix(self.sched, pd.req.input_ids)

    def after_harvest(self, t: int, harvest_slot: int) -> None:
        verdicts = self.vote.pass2(harvest_slot)
        t_cast = self._t_cast.pop(harvest_slot, None)
        if t_cast is not None:
            self.observe("consensus:decode_votes", time.monotonic() - t_cast)
        pre = {pd.room: pd for pd in self.prealloc if pd.pages}
        good, bad, _ = verdicts[PREALLOC].partition(
            lambda room: room in pre and done_for(PREALLOC, pre[room].transfer.poll()), PREALLOC
        )
        self._apply_prealloc(pre, good, bad)
        good, bad, _ = verdicts[TRANSFERRED].partition(
            lambda room: (
                room in self.transfer and done_for(TRANSFERRED, self.transfer[room].transfer.poll())
            ),
            TRANSFERRED,
        )
        self._apply_transferred(good, bad, harvest_slot)
        good, _, _ = verdicts[RELEASE].partition(lambda room: room in self.quarantine, RELEASE)
        self._release_quarantine(good)
        if self._traced_status:
            self._trace_retractions()

    def _trace_retractions(self) -> None:
        """Events on a traced request's decode span when the scheduler retracts or resumes it."""
        for rid, last in list(self._traced_status.items()):
            req = self.sched.reqs.get(rid)
            if req is None:
                continue
            now = req.status.value
            if now != last:
                self._traced_status[rid] = now
                if now == "retracted":
                    self.spans.event(rid, "decode", "retracted")
                elif last == "retracted":
                    self.spans.event(rid, "decode", "resumed")

    @rank_consensus("pd_quarantine_release", args=lambda self, good: sorted(good))
    def _release_quarantine(self, good: frozenset) -> None:
        for room in sorted(good):
            pd = self.quarantine.pop(room)
            self.sched.allocator.free(pd.pages)
            if self.sched.window_pages is not None:
                self.sched.window_pages.allocator.free(pd.sliding)
            pd.pages, pd.sliding = [], []
            heapq.heappush(self.aux_free, pd.aux_slot)

    @rank_consensus(
        "pd_prealloc_verdict", args=lambda self, pre, good, bad: [sorted(good), sorted(bad)]
    )
    def _apply_prealloc(self, pre: dict[int, PDReq], good: frozenset, bad: frozenset) -> None:
        for room in sorted(good | bad):
            pd = pre[room]
            self.prealloc.remove(pd)
            if room in good:
                self.transfer[room] = pd
                self._stage_done(pd.rid, "prealloc", "transfer")
            else:
                self._stage_done(pd.rid, "prealloc")
                self._fail(pd, AbortReason.BOOTSTRAP_FAILED, "KV preallocation failed")

    @rank_consensus(
        "pd_transferred_verdict",
        args=lambda self, good, bad, slot: [sorted(good), sorted(bad), slot],
    )
    def _apply_transferred(self, good: frozenset, bad: frozenset, harvest_slot: int) -> None:
        for room in sorted(good | bad):
            pd = self.transfer.pop(room)
            self._stage_done(pd.rid, "transfer")
            if room in good:
                self._start_decoding(pd, harvest_slot)
            else:
                self._fail(pd, AbortReason.KV_TRANSFER_FAILED, "KV transfer failed")

    def _start_decoding(self, pd: PDReq, slot: int) -> None:
        tok, lp, top = unpack_aux(pd.transfer.read_aux())
        req = pd.req
        req.output_ids.append(tok)
        if req.params.logprobs and lp is not None:
            req.output_logprobs.append(lp)
            req.output_top_logprobs.append(top or [])
        heapq.heappush(self.aux_free, pd.aux_slot)
        self.by_rid.pop(pd.rid, None)
        self.emit(
            TokenEvent(
                pd.rid,
                tok,
                lp if req.params.logprobs else None,
                top if req.params.top_logprobs else None,
            )
        )
        held, pd.held = pd.held or HeldPrefix(), None  # the scheduler's request owns the lock now
        # the prompt's pages before the window came without their sliding layers' KV
        moved_from = self._window_start(req.seq_len - 1) // self.kv_mgr.pool.page_size
        self.sched.add_prefilled(
            req, held.pages + pd.pages, slot, held.tokens, held.handle, moved_from
        )
        if self.spans.on(pd.rid):
            self.spans.end(pd.rid, "first_token", token=tok)
            self.spans.start(pd.rid, "decode")
            self._traced_status[pd.rid] = "running"
        if self.is_first and req.rid in self.sched.reqs:
            self._t_running[req.rid] = time.monotonic()

    def _window_start(self, num_tokens: int) -> int:
        """The first token whose sliding layers' KV a room of `num_tokens` receives."""
        pool = self.kv_mgr.pool
        return window_start(num_tokens, pool.window, pool.page_size)

    def on_finished(self, req: Req) -> None:
        if self.spans.on(req.rid):
            self._traced_status.pop(req.rid, None)
            self.spans.end(req.rid, "decode", output_tokens=len(req.output_ids))
            f = req.finish
            detail = {"message": f.message} if f is not None and f.message else {}
            self.spans.finish(req.rid, f.kind if f is not None else "unknown", **detail)

    def _fail(self, pd: PDReq, reason: AbortReason, what: str) -> None:
        """The client hears at once; the pages (and aux slot) wait in quarantine until every rank
        agrees, by the release vote, that no prefill write can land in them any more. A cached
        prefix it held is unlocked at once: it was never registered, so nothing writes it."""
        release_prefix(self.sched, pd.held)
        pd.held = None
        self.quarantine[pd.room] = pd
        why = pd.transfer.reason or "a decode rank failed"
        # The room failed on some rank: this rank's own end may still be waiting for its prefill
        # writers. Ended, it tells them (KVAbort), and their final word clears the quarantine
        # at once instead of after the grace period.
        pd.transfer.abort(FAILED_ELSEWHERE)
        if pd.aborted:
            self._end(pd, pd.reason)
        else:
            self._end(pd, reason, f"{what}: {why}")
