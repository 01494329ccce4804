"""The deterministic scheduler: continuous batching, chunked prefill, prefix sharing, retraction.

Every PP rank runs one of these on the same replicated inputs (new requests, aborts, sampled
tokens), so its decisions must be a pure function of its call sequence (docs/ARCHITECTURE.md section
4): no wall clock, no unordered iteration, no rank-local resource readings. Capacities come from the
config, which the ranks agree on at start-up.

One request computes tokens `[kv_len, kv_len + num_new)` of `all_ids` per batch and samples when
that reaches `seq_len`. A fresh prompt is prefilled in chunks; a decode step is the case
`seq_len - kv_len == 1`; a retracted request re-prefills prompt + outputs, usually from the prefix
cache. Requests are bound to the microbatch slot that admitted them: `slot` schedules only its
own running requests (plus admissions), and only after its previous outputs were harvested. A
guided request samples only once its guide is compiled (engine/guide_hold.py).

Abort: a waiting request is removed at once; an admitted request that is not in flight is torn down
at once (no rank's forward can still be reading its pages); one in flight gets `to_finish` and ends
when its slot is harvested. All three happen at the same logical moment on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from pdserve.consensus.rank_checker import rank_consensus
from pdserve.engine.batch import BatchEntry, SampleOut, ScheduledBatch
from pdserve.engine.core import FinishReason, ParamError, Req, ReqStatus, SamplingParams, Share
from pdserve.engine.fair_queue import FairQueue
from pdserve.engine.guide_hold import GuideHold, held
from pdserve.engine.kv_cache import PageAllocator, pages_needed
from pdserve.engine.prefill_shares import PrefillShares, fair_cap
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.scheduler_config import SchedulerConfig, check_admissible
from pdserve.engine.stop_reason import stop_reason
from pdserve.engine.window_pages import WindowPages

__all__ = ["Scheduler", "SchedulerConfig"]  # SchedulerConfig: imported from here as before


def _prefilled_digest(self, req, pages, slot, cached_len=0, prefix_node=None, partial_pages=0):
    return [req.rid, list(pages), slot, cached_len, partial_pages, req.sliding_pages]


class Scheduler(GuideHold):
    def __init__(
        self,
        cfg: SchedulerConfig,
        allocator: PageAllocator,
        eos_token_ids: tuple[int, ...] = (),
        detokenize: Callable[[list[int]], str] | None = None,
        hold_kv_on_finish: bool = False,
        sliding_allocator: PageAllocator | None = None,
    ):
        super().__init__()
        self.cfg, self.allocator = cfg, allocator
        self.eos_token_ids = tuple(eos_token_ids)
        self.detokenize = detokenize
        self.cache = None
        if cfg.enable_prefix_cache:
            self.cache = PrefixCache(allocator, cfg.page_size, cfg.window, sliding_allocator)
        # a windowed pool's sliding layers: pages of their own, freed behind the window
        live = lambda: [(r, r.seq_len - r.kv_len <= 1) for s in self.slots for r in s]  # noqa: E731
        self.window_pages = WindowPages.make(
            sliding_allocator, cfg, hold_kv_on_finish, self.cache, live
        )
        self.waiting = FairQueue()  # in fair order between tenants (engine/fair_queue.py)
        self.slots: list[list[Req]] = [[] for _ in range(cfg.num_slots)]
        self.reqs: dict[str, Req] = {}  # live requests, insertion ordered
        self.just_finished: list[Req] = []  # drained by the caller
        self._arrivals = 0
        self.num_retractions = 0
        # Prefill side of PD: a request that ends keeps its pages until `release(rid)`: its KV may
        # still be on the wire (even after an abort, a transfer thread may be reading them).
        self.hold_kv_on_finish = hold_kv_on_finish
        self.kept_kv: dict[str, Req] = {}  # finished, KV kept until `release` (hold_kv_on_finish)
        # the shares of the requests a PD loop holds before they reach this scheduler (rooms in
        # bootstrap, in prealloc or in transfer): they count for `fair_prefill_tokens`
        self.held_elsewhere: Callable[[], Iterable[Share]] = tuple

    # --- inputs -----------------------------------------------------------------------------------
    def check_admissible(self, prompt_len: int, params: SamplingParams) -> None:
        """ParamError for a request that could never run (too long for the context or pool)."""
        check_admissible(self.cfg, self.allocator.num_pages, prompt_len, params)

    @rank_consensus(
        "add",
        args=lambda self, req: [req.rid, len(req.input_ids), *dataclasses.astuple(req.share)],
    )
    def add(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ParamError("rid", f"duplicate request id {req.rid!r}")
        self.check_admissible(len(req.input_ids), req.params)
        self._arrivals += 1
        req.arrival = self._arrivals
        req.status = ReqStatus.WAITING
        self.reqs[req.rid] = req
        # a resumed request (output_ids given) whose output already ends it: its stream was cut
        # after the stop token, or at max_tokens, before its finish chunk went out
        reason = self._stop_reason(req) if req.output_ids else None
        if reason is not None:
            self._finish(req, reason)
            return
        self.waiting.push(req, req.arrival)

    @rank_consensus("abort", args=lambda self, rid, message="": rid, result=lambda r: r is not None)
    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return None
        reason = FinishReason("abort", message)
        if req.status in (ReqStatus.WAITING, ReqStatus.RETRACTED):
            self.waiting.remove(req)
            self._finish(req, reason)
        elif req.in_flight:
            req.to_finish = reason
        else:
            self._finish(req, reason)
        return req

    # --- scheduling -------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return sum(len(s) for s in self.slots)

    @property
    def has_work(self) -> bool:
        """A request waits, or a running one is not held by its guide's compile (`held`)."""
        return bool(self.waiting) or any(not held(r) for s in self.slots for r in s)

    def free_pages_for(self, n: int) -> bool:
        """Makes `n` pages free if it can, evicting unreferenced prefix-cache pages."""
        short = n - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.allocator.can_alloc(n)

    def _grow(self, req: Req, upto_tokens: int) -> None:
        need = pages_needed(upto_tokens, self.cfg.page_size) - len(req.pages)
        if need > 0:
            req.pages.extend(self.allocator.alloc(need))

    @rank_consensus("schedule", args=lambda self, slot: slot, result=ScheduledBatch.digest)
    def schedule(self, slot: int) -> ScheduledBatch:
        batch = ScheduledBatch(slot, awaits_guides=self.guides_pending > 0)
        members = self.slots[slot]
        assert not any(r.in_flight for r in members), f"slot {slot} scheduled before its harvest"
        budget = self.cfg.max_batch_tokens
        # 1. Running requests of this slot; decodes (1 token) need at most one new page each.
        decodes = [r for r in members if r.seq_len - r.kv_len == 1 and not r.guide_pending]
        while decodes:
            need = sum(
                1
                for r in decodes
                if r.kv_len % self.cfg.page_size == 0
                and pages_needed(r.kv_len + 1, self.cfg.page_size) > len(r.pages)
            )
            if self.free_pages_for(need):
                break
            self._retract(max(decodes, key=lambda r: r.arrival))  # youngest first
            decodes = [r for r in members if r.seq_len - r.kv_len == 1 and not r.guide_pending]
        for r in decodes[:budget]:
            self._grow(r, r.kv_len + 1)
            self._place(batch, r, 1)
        budget -= len(batch.entries)
        if self.cfg.mixed_prefill_tokens and self._any_decoding():
            budget = min(budget, self.cfg.mixed_prefill_tokens)
        # 2. Prefill chunks, in fair order (engine/fair_queue.py) across the prompts admitted to
        #    this slot and the waiting queue's head: a prompt that waits goes before admitted ones
        #    with later tags, so another tenant's flood, once admitted, does not hold the budget
        #    until its prompts end. With one tenant the admitted go first, then admissions: first
        #    come first served. A head that does not fit blocks the queue behind it. With two
        #    tenants on the node, the forward's prompt tokens are the first one's (PrefillShares).
        prefilling = [r for r in members if r.seq_len - r.kv_len > 1]
        prefilling.sort(key=lambda r: r.fair_key)
        share = PrefillShares(fair_cap(self.cfg, self.reqs.values(), self.held_elsewhere))
        blocked, i = False, 0
        while budget > 0:
            nxt = prefilling[i] if i < len(prefilling) else None
            if (
                not blocked
                and self.waiting
                and self.num_running < self.cfg.max_running
                and (nxt is None or self.waiting.head().fair_key < nxt.fair_key)
            ):
                req = self.waiting.head()
                if not (share.left(req) and self._admit(req, reserve=self.num_running)):
                    blocked = True
                    continue
                self.waiting.pop_head()
                members.append(req)
                nxt = req
            elif nxt is None:
                break
            else:
                i += 1
            left = nxt.seq_len - nxt.kv_len - nxt.guide_pending  # no sample while it compiles
            n = min(left, self.cfg.chunk_size, budget, share.left(nxt))
            if n:
                share.take(nxt, n)
                self._place(batch, nxt, n)
                budget -= n
        return batch

    def _any_decoding(self) -> bool:
        """A request of any slot past its prompt, not re-prefilling nor `held`: its next token
        waits for every forward, the other slots' too (a pipeline runs them in turn)."""
        decoding = (r for s in self.slots for r in s if r.output_ids and not held(r))
        return any(r.seq_len - r.kv_len <= 1 for r in decoding)

    def _admit(self, req: Req, reserve: int) -> bool:
        """Locks the cached prefix and allocates pages for every token the request has."""
        pages: list[int] = []
        handle = None
        if self.cache is not None:
            pages, handle = self.cache.match(req.all_ids, req.seq_len - 1)
            self.cache.lock(handle)
        need = pages_needed(req.seq_len, self.cfg.page_size) - len(pages)
        wp = self.window_pages
        if not self.free_pages_for(need + reserve) or (wp and not wp.admits(handle, len(pages))):
            if handle is not None:
                assert self.cache is not None  # a handle comes only from the cache
                self.cache.unlock(handle)
            return False
        req.pages = pages + self.allocator.alloc(need)
        if wp is not None:
            wp.adopt(req, handle, len(pages))
        req.prefix_node = handle
        req.cached_len = len(pages) * self.cfg.page_size
        req.kv_len = req.cached_len
        req.status = ReqStatus.RUNNING
        if self.cache is not None:
            self.cache.hit_tokens_total += req.cached_len
        return True

    def _place(self, batch: ScheduledBatch, req: Req, n: int) -> None:
        start = req.kv_len
        req.kv_len += n
        req.in_flight = True
        entry = BatchEntry(req, start, n, req.kv_len == req.seq_len, list(req.pages))
        if self.window_pages is not None:
            self.window_pages.place(req, start, n)
            entry.sliding_pages = self.window_pages.page_table(req)
        batch.entries.append(entry)

    def _retract(self, req: Req) -> None:
        """Preempts a running request that is not in flight: its KV goes back
        (to the prefix cache)."""
        assert not req.in_flight, f"retracting {req.rid} while in flight"
        self.slots[self._slot_of(req)].remove(req)
        self._release_kv(req)
        req.status = ReqStatus.RETRACTED
        req.kv_len = req.cached_len = req.partial_pages = 0  # resumed, it computes its own KV
        self.waiting.requeue(req)
        self.num_retractions += 1

    def _slot_of(self, req: Req) -> int:
        for i, s in enumerate(self.slots):
            if req in s:
                return i
        raise AssertionError(f"{req.rid} is in no slot")

    # --- outputs ----------------------------------------------------------------------------------
    @rank_consensus(
        "harvest",
        args=lambda self, batch, out: [batch.slot, out.token_ids if out else None],
        result=lambda r: [q.rid for q in r],
    )
    def harvest(self, batch: ScheduledBatch, out: SampleOut | None) -> list[Req]:
        """Applies a batch's sampled tokens; returns the requests that got a token
        (in batch order)."""
        got, k = [], 0
        for e in batch.entries:
            req = e.req
            req.in_flight = False
            if e.need_logits:
                assert out is not None, "a sampling batch was harvested without outputs"
                if req.to_finish is None and e.start < req.prompt_len:
                    self._cache_prompt(req)
                if req.to_finish is None:
                    req.output_ids.append(out.token_ids[k])
                    if out.logprobs is not None:
                        req.output_logprobs.append(out.logprobs[k])
                    if out.top_logprobs is not None:
                        req.output_top_logprobs.append(out.top_logprobs[k])
                    got.append(req)
                    self._check_stop(req)
                k += 1
            if req.to_finish is not None and not req.finished:
                self._finish(req, req.to_finish)
        return got

    @rank_consensus("cache_prompt", args=lambda self, req: [req.rid, req.prompt_len])
    def _cache_prompt(self, req: Req) -> None:
        """The prompt's KV is complete: its whole pages go into the prefix cache now, not at
        finish, so a request with the same prompt admitted from now on (an `n` > 1 sibling) finds
        them (engine/prefix_cache.py `cache_prefix`)."""
        full = req.prompt_len // self.cfg.page_size
        if (
            self.cache is None
            or req.prefix_node is None
            or full <= req.cached_len // self.cfg.page_size
        ):
            return
        own = self.window_pages.own_pages(req) if self.window_pages is not None else None
        req.prefix_node = self.cache.cache_prefix(
            req.input_ids, req.pages, full, req.prefix_node, req.partial_pages, own
        )

    def _check_stop(self, req: Req) -> None:
        reason = self._stop_reason(req)
        if reason is not None:
            self._finish(req, reason)

    def _stop_reason(self, req: Req) -> FinishReason | None:
        """Why the request's last output token ends it, if it does."""
        return stop_reason(req, self.eos_token_ids, self.detokenize, self.cfg.max_context)

    @rank_consensus("finish", args=lambda self, req, reason: [req.rid, reason.kind, req.kv_len])
    def _finish(self, req: Req, reason: FinishReason) -> None:
        if req.status == ReqStatus.RUNNING:
            self.slots[self._slot_of(req)].remove(req)
            if self.hold_kv_on_finish:
                self.kept_kv[req.rid] = req
            else:
                self._release_kv(req)
        req.finish = reason
        req.status = ReqStatus.FINISHED
        self.reqs.pop(req.rid, None)
        self.just_finished.append(req)

    def _release_kv(self, req: Req) -> None:
        wp = self.window_pages
        if self.cache is not None:
            free = self.cache.insert(
                req.all_ids,
                req.pages,
                req.kv_len,
                req.cached_len // self.cfg.page_size,
                req.partial_pages,
                wp.own_pages(req) if wp is not None else None,
            )
            self.cache.unlock(req.prefix_node)
            req.prefix_node = None
        else:
            free = req.pages
        self.allocator.free(free)
        req.pages = []
        if wp is not None:
            wp.release(req, given_to_cache=self.cache is not None)

    @rank_consensus("release", args=lambda self, rid: rid)
    def release(self, rid: str) -> None:
        """Frees the pages a finished request kept (`hold_kv_on_finish`)."""
        self._release_kv(self.kept_kv.pop(rid))

    @rank_consensus("add_prefilled", args=_prefilled_digest)
    def add_prefilled(
        self,
        req: Req,
        pages: list[int],
        slot: int,
        cached_len: int = 0,
        prefix_node=None,
        partial_pages: int = 0,
    ) -> None:
        """Decode side of PD: the KV of the prompt and of every output token but the last (a
        migrated stream's resumed tokens) is in `pages` (the first `cached_len` tokens' pages from
        the prefix cache, locked by `prefix_node`, the rest transferred; the first
        `partial_pages` without their sliding layers' KV), and the last output token
        is the one the prefill node sampled; the request joins `slot` as a running decode (it may
        finish at once). The request owns the lock from here: it is unlocked at finish or
        retraction. A windowed pool's sliding table is set already (WindowPages.for_transfer)."""
        self._arrivals += 1
        req.arrival = self._arrivals
        req.pages, req.kv_len, req.cached_len = list(pages), req.seq_len - 1, cached_len
        req.partial_pages = partial_pages
        req.prefix_node = prefix_node
        req.status = ReqStatus.RUNNING
        self.reqs[req.rid] = req
        self.slots[slot].append(req)
        self._check_stop(req)

    def drain_finished(self) -> list[Req]:
        out, self.just_finished = self.just_finished, []
        return out

    # --- observability ----------------------------------------------------------------------------
    @property
    def used_tokens(self) -> int:
        """KV tokens held by live requests (0 when idle, whatever the prefix cache holds)."""
        kept = sum(r.kv_len for r in self.kept_kv.values())
        return kept + sum(r.kv_len for s in self.slots for r in s)

    def held_pages(self) -> int:
        """Pages live or kept requests hold, prefix-cache pages excluded (0 when nothing runs)."""
        cached = self.cache.num_cached_pages if self.cache is not None else 0
        return self.allocator.num_used - cached
