"""Decode side: one KVReceiver per room on every decode rank, owned by a DecodeKVManager.

Receiver states (KVPoll):
  Bootstrapping    asking the prefill node's bootstrap server which prefill ranks hold this rank's
                   layers and KV heads (cached per server), and waiting for `register`
                                                                              -> bootstrap timeout
  WaitingForInput  registration sent to every overlapping prefill rank; waiting for one Success
                   from each                                                  -> waiting timeout
  Success          every overlapping prefill rank reported Success and the aux slot holds this
                   room's aux data (and, with the checksum flag, the KV matches)
  Failed           terminal: a prefill Failed/Abort, a timeout, a dead peer, or our own abort; once
                   the registration went out, every prefill rank of the route that has not sent
                   its final word is told (KVAbort), whatever the reason
The scheduler only calls `register`, `poll`, `read_aux` and `abort`; none of them blocks.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

from pdserve.consensus.kvpoll import KVPoll
from pdserve.kv_transfer.base import BaseKVReceiver
from pdserve.kv_transfer.bootstrap import PrefillRankInfo
from pdserve.kv_transfer.bootstrap_client import BootstrapTimeout
from pdserve.kv_transfer.checksum import kv_checksum
from pdserve.kv_transfer.layout import intersect, window_start
from pdserve.kv_transfer.manager import read_aux, sender_id
from pdserve.kv_transfer.messages import KVAbort, KVRegister, KVStatus
from pdserve.kv_transfer.stats import kv_bytes

if TYPE_CHECKING:
    from pdserve.kv_transfer.decode_manager import DecodeKVManager


class KVReceiver(BaseKVReceiver):
    def __init__(self, mgr: DecodeKVManager, room: int, bootstrap_addr: str):
        self.room, self.bootstrap_addr = room, bootstrap_addr
        self._mgr = mgr
        self._lock = threading.Lock()
        self._status = KVPoll.Bootstrapping
        self.reason: str | None = None
        self._route: list[PrefillRankInfo] | None = None
        self._page_ids: tuple | None = None
        self._aux_slot: int | None = None
        self._prefix = 0  # prompt tokens this rank holds already (its prefix cache): not sent
        self._sliding: tuple[int, tuple[int, ...]] = (0, ())  # a windowed pool's (first, table)
        self._sent = False
        self._done: dict[int, KVStatus] = {}
        self.created_at = time.monotonic()
        self.registered_at: float | None = None
        self.finished_at: float | None = None
        self._aux: bytes | None = None
        self._quiet: set[int] = set()  # prefill ranks that sent a terminal message: no more writes

    def poll(self) -> KVPoll:
        return self._status

    def register(
        self, page_ids, aux_slot: int | None = None, prefix_tokens: int = 0, sliding=None
    ) -> None:
        """This rank's page table for the prompt after the `prefix_tokens` it holds (page i = tokens
        [prefix + i*ps, prefix + (i+1)*ps)) and the aux slot the first token lands in; sent to the
        prefill ranks as soon as the route is known. `sliding`: a windowed pool's (first page,
        sliding table) (kv_transfer/targets.py)."""
        if prefix_tokens < 0 or prefix_tokens % self._mgr.pool.page_size:
            raise ValueError(f"room {self.room}: prefix of {prefix_tokens} tokens not page-aligned")
        if (sliding is None) != (self._mgr.sliding_pool is None):
            raise ValueError(f"room {self.room}: a sliding table is for a windowed pool only")
        if aux_slot is not None:
            self._mgr.clear_aux(self._mgr.aux_ptr(aux_slot))  # aux_ptr validates the slot
        with self._lock:
            if self._page_ids is not None:
                raise ValueError(f"room {self.room}: registered twice")
            self._page_ids = tuple(int(p) for p in page_ids)
            self._aux_slot = aux_slot
            self._prefix = prefix_tokens
            if sliding is not None:
                self._sliding = (int(sliding[0]), tuple(int(p) for p in sliding[1]))
        self._maybe_send_registration()

    def read_aux(self) -> bytes | None:
        """The aux data (first token and logprobs) once Success; None before."""
        return self._aux if self._status == KVPoll.Success else None

    def abort(self, reason: str = "aborted") -> None:
        self._fail(reason)

    def prefill_sessions(self) -> list[str]:
        with self._lock:
            return [r.session_id for r in self._route] if self._route else []

    # ---- called by the manager's threads ----------------------------------------------------

    def on_route(self, fut: Future) -> None:
        try:
            route = fut.result()
        except Exception as e:  # BootstrapTimeout, ValueError from a bad answer
            self._fail(
                "bootstrap_timeout" if isinstance(e, BootstrapTimeout) else "bootstrap_error",
                detail=str(e),
            )
            return
        mine = self._mgr.pool
        for r in route:
            head_bytes = r.token_bytes // (r.head_end - r.head_start)
            if head_bytes != mine.head_bytes or r.dtype != mine.dtype:
                self._fail(
                    "incompatible",
                    detail=f"prefill rank {r.rank} has {r.dtype}/{head_bytes} B per head",
                )
                return
        with self._lock:
            self._route = [
                r
                for r in route
                if intersect((r.layer_start, r.layer_end), mine.layers)
                and intersect(r.heads, mine.heads)
            ]
        self._maybe_send_registration()

    def _maybe_send_registration(self) -> None:
        mgr = self._mgr
        with self._lock:
            if (
                self._sent
                or self._route is None
                or self._page_ids is None
                or self._status != KVPoll.Bootstrapping
            ):
                return
            self._sent = True
            # registered_at before the status: the reaper reads the status without the lock
            self.registered_at = time.monotonic()
            self._status = KVPoll.WaitingForInput
            route, pages, slot = self._route, self._page_ids, self._aux_slot
        aux_ptr = mgr.aux_ptr(slot) if slot is not None else 0
        aux_len = mgr.config.aux_slot_bytes if slot is not None else 0
        for r in route:
            mgr.send(
                r.host,
                r.ctrl_port,
                KVRegister(
                    self.room,
                    mgr.rank,
                    mgr.dst_slices,
                    mgr.config.host,
                    mgr.ctrl_port,
                    mgr.session_id,
                    mgr.pool,
                    pages,
                    aux_ptr,
                    aux_len,
                    mgr.aux_base,
                    mgr.aux_slots * mgr.config.aux_slot_bytes,
                    self._prefix,
                    mgr.sliding_pool,
                    self._sliding[1],
                    self._sliding[0],
                ),
            )

    def is_peer(self, prefill_rank: int, sender: str) -> bool:
        """Whether `sender` is the manager of `prefill_rank` on this room's route (only those may
        end the room or report its KV landed)."""
        with self._lock:
            route = self._route if self._sent else None
        return route is not None and any(
            r.rank == prefill_rank and sender_id(r.session_id, r.ctrl_port) == sender for r in route
        )

    def note_quiet(self, prefill_rank: int) -> None:
        with self._lock:
            self._quiet.add(prefill_rank)

    def quiesced(self, grace_s: float) -> bool:
        """True once no prefill rank can write into this room's pages any more: Success, never
        registered, every prefill rank of the route sent its terminal message (senders send it only
        after their last write returned), or `grace_s` after the failure (beyond the transfer
        engine's own write timeout). Pages of a failed room are reused only then. A `peer_dead`
        room waits for the grace too: heartbeat silence does not tell a dead rank from a stalled
        one (SIGSTOP, a long pause), and a stalled rank resumes the write it was in."""
        with self._lock:
            if self._status == KVPoll.Success or (self._status == KVPoll.Failed and not self._sent):
                return True
            if self._status != KVPoll.Failed:
                return False
            if self._route is not None and {r.rank for r in self._route} <= self._quiet:
                return True
            assert self.finished_at is not None  # _fail sets it with the Failed status
            return time.monotonic() - self.finished_at > grace_s

    def on_status(self, msg: KVStatus) -> None:
        self.note_quiet(msg.src_rank)  # first: _fail tells only the ranks not quiet
        if msg.status == KVPoll.Failed:
            self._fail(f"prefill_failed:{msg.reason}" if msg.reason else "prefill_failed")
            return
        with self._lock:
            if self._route is None or msg.src_rank not in {r.rank for r in self._route}:
                unexpected = True
            else:
                unexpected = False
                self._done[msg.src_rank] = msg
        if unexpected:
            self._mgr.stats.add_dropped("unexpected_rank")
            return
        self.try_finish()

    def try_finish(self) -> None:
        """Success once every prefill rank reported it and the aux slot holds this room's data."""
        mgr = self._mgr
        with self._lock:
            if self._status != KVPoll.WaitingForInput:
                return
            # _maybe_send_registration sets WaitingForInput only once the route, the page table and
            # registered_at are known; none of them is unset again
            assert self._route is not None and self._page_ids is not None
            assert self.registered_at is not None
            if len(self._done) != len(self._route):
                return
            done, route, pages, slot = dict(self._done), self._route, self._page_ids, self._aux_slot
        aux = None
        if any(s.aux_bytes for s in done.values()):
            if slot is None:
                return self._fail("aux_unexpected")
            aux = read_aux(mgr.aux_ptr(slot), self.room, mgr.config.aux_slot_bytes)
            if aux is None:
                # Not landed yet (cannot happen over a completed write); the reaper retries.
                return
        held = self._prefix
        num_tokens = max(s.num_tokens for s in done.values())
        slide_from = window_start(num_tokens, mgr.pool.window, mgr.pool.page_size)
        if mgr.config.checksum:
            bad = self._checksum_mismatch(route, done, pages, slide_from)
            if bad is not None:
                return self._fail("checksum_mismatch", detail=f"prefill rank {bad}")
        per_token = mgr.pool.num_layers * 2 * mgr.pool.token_bytes
        received = spared = 0
        for r in route:
            layers, heads = self._shared(r)
            moved, window_bytes = kv_bytes(
                mgr.pool, layers, held, done[r.rank].num_tokens, slide_from, heads
            )
            received, spared = received + moved, spared + window_bytes
        with self._lock:
            if self._status != KVPoll.WaitingForInput:
                return
            self._aux = aux
            self._status = KVPoll.Success
            self.finished_at = time.monotonic()
        mgr.stats.add_received(received)
        mgr.stats.add_success(self.room, self.finished_at - self.registered_at, received)
        mgr.stats.add_room_tokens(max(0, num_tokens - held), held, held * per_token, spared)

    def _checksum_mismatch(self, route, done, pages, slide_from: int) -> int | None:
        """The first prefill rank of `route` whose checksum differs from the KV that landed."""
        mgr, held = self._mgr, self._prefix
        split = None
        if mgr.sliding_pool is not None:
            split = (mgr.sliding_pool, self._sliding[1], self._sliding[0])
        for r in route:
            layers, heads = self._shared(r)
            got = kv_checksum(
                mgr.pool,
                pages,
                layers,
                done[r.rank].num_tokens,
                token_start=held,
                first_page=held // mgr.pool.page_size,
                slide_from=slide_from,
                heads=heads,
                sliding=split,
            )
            if done[r.rank].checksum is None or got != done[r.rank].checksum:
                return r.rank
        return None

    def _shared(self, r: PrefillRankInfo) -> tuple[tuple[int, int], tuple[int, int]]:
        """The layers and KV heads prefill rank `r` and this rank both hold."""
        pool = self._mgr.pool
        layers = intersect((r.layer_start, r.layer_end), pool.layers)
        heads = intersect(r.heads, pool.heads)
        assert layers is not None and heads is not None  # on_route keeps only ranks that overlap
        return layers, heads

    def check_timeouts(self, now: float) -> None:
        cfg = self._mgr.config
        if (
            self._status == KVPoll.Bootstrapping
            and self._route is None
            and now - self.created_at > cfg.bootstrap_timeout_s
        ):
            self._fail("bootstrap_timeout")
        elif self._status == KVPoll.WaitingForInput and self.registered_at is not None:
            if now - self.registered_at > cfg.waiting_timeout_s:
                self._fail("waiting_timeout")
            elif self._done:
                self.try_finish()

    def _fail(self, reason: str, detail: str = "") -> None:
        """Failed, and a KVAbort to every prefill rank of the route that may still write: the
        registration went out and the rank has not sent its final word (`_quiet`). That covers the
        failures this rank decides itself (an abort, its timeouts, `peer_dead`, `bootstrap_lost`,
        `checksum_mismatch`, `aux_unexpected`), so a sender still writing stops after its write in
        flight and answers with its final word instead of writing on into pages that are reused
        once the grace ran out (finding 1 of docs/PROTOCOL_MODEL.md). A failure that came from a
        prefill rank (its Failed status or KVAbort, noted quiet first) is not echoed to it; the
        other ranks of the route are told. `mgr.send` never blocks, so a dead peer costs nothing."""
        with self._lock:
            if self._status in (KVPoll.Failed, KVPoll.Success):
                return
            self._status, self.reason = KVPoll.Failed, reason
            self.finished_at = time.monotonic()
            tell: list[PrefillRankInfo] = []
            if self._sent:
                assert self._route is not None  # _sent is set only once the route is known
                tell = [r for r in self._route if r.rank not in self._quiet]
        mgr = self._mgr
        mgr.stats.add_failure(reason.split(":")[0])
        say = mgr.debug if reason.startswith("aborted") else mgr.warn  # aborts are routine
        say("room %d failed: %s %s", self.room, reason, detail)
        for r in tell:
            mgr.send(r.host, r.ctrl_port, KVAbort(self.room, "decode", mgr.rank, reason[:200]))
