"""Decode side: one KVReceiver per room on every decode rank, owned by a DecodeKVManager.

Receiver states (KVPoll):
  Bootstrapping    asking the prefill node's bootstrap server which prefill ranks hold this rank's
                   layers (cached per server), and waiting for `register`    -> bootstrap timeout
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

import ctypes
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from consensus.kvpoll import KVPoll
from kv_transfer.bootstrap import PrefillRankInfo
from kv_transfer.bootstrap_client import BootstrapClient, BootstrapTimeout
from kv_transfer.checksum import kv_checksum
from kv_transfer.engine import MooncakeEngine
from kv_transfer.layout import PoolDesc, intersect
from kv_transfer.manager import AUX_HEADER, KVManagerBase, TransferConfig, read_aux, sender_id
from kv_transfer.messages import KVAbort, KVRegister, KVStatus, Message


class KVReceiver:
    def __init__(self, mgr: DecodeKVManager, room: int, bootstrap_addr: str):
        self.room, self.bootstrap_addr = room, bootstrap_addr
        self._mgr = mgr
        self._lock = threading.Lock()
        self._status = KVPoll.Bootstrapping
        self.reason: str | None = None
        self._route: list[PrefillRankInfo] | None = None
        self._page_ids: tuple | None = None
        self._aux_slot: int | None = None
        self._sent = False
        self._done: dict[int, KVStatus] = {}
        self.created_at = time.monotonic()
        self.registered_at: float | None = None
        self.finished_at: float | None = None
        self._aux: bytes | None = None
        self._quiet: set[int] = set()  # prefill ranks that sent a terminal message: no more writes

    def poll(self) -> KVPoll:
        return self._status

    def register(self, page_ids, aux_slot: int | None = None) -> None:
        """This rank's page table for the prompt (page i = tokens [i*ps, (i+1)*ps)) and the aux slot
        the first token lands in; sent to the prefill ranks as soon as the route is known."""
        if aux_slot is not None:
            self._mgr.clear_aux(self._mgr.aux_ptr(aux_slot))  # aux_ptr validates the slot
        with self._lock:
            if self._page_ids is not None:
                raise ValueError(f"room {self.room}: registered twice")
            self._page_ids = tuple(int(p) for p in page_ids)
            self._aux_slot = aux_slot
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
            if r.token_bytes != mine.token_bytes or r.dtype != mine.dtype:
                self._fail(
                    "incompatible", detail=f"prefill rank {r.pp_rank} has {r.dtype}/{r.token_bytes}"
                )
                return
        with self._lock:
            self._route = [r for r in route if intersect((r.layer_start, r.layer_end), mine.layers)]
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
            self._status = KVPoll.WaitingForInput
            self.registered_at = time.monotonic()
            route, pages, slot = self._route, self._page_ids, self._aux_slot
        aux_ptr = mgr.aux_ptr(slot) if slot is not None else 0
        aux_len = mgr.config.aux_slot_bytes if slot is not None else 0
        for r in route:
            mgr.send(
                r.host,
                r.ctrl_port,
                KVRegister(
                    self.room,
                    mgr.pp_rank,
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
                ),
            )

    def is_peer(self, prefill_rank: int, sender: str) -> bool:
        """Whether `sender` is the manager of `prefill_rank` on this room's route (only those may
        end the room or report its KV landed)."""
        with self._lock:
            route = self._route if self._sent else None
        return route is not None and any(
            r.pp_rank == prefill_rank and sender_id(r.session_id, r.ctrl_port) == sender
            for r in route
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
            if self._route is not None and {r.pp_rank for r in self._route} <= self._quiet:
                return True
            return time.monotonic() - self.finished_at > grace_s

    def on_status(self, msg: KVStatus) -> None:
        self.note_quiet(msg.src_rank)  # first: _fail tells only the ranks not quiet
        if msg.status == KVPoll.Failed:
            self._fail(f"prefill_failed:{msg.reason}" if msg.reason else "prefill_failed")
            return
        with self._lock:
            if self._route is None or msg.src_rank not in {r.pp_rank for r in self._route}:
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
            if self._status != KVPoll.WaitingForInput or len(self._done) != len(self._route):
                return
            done, route, pages, slot = dict(self._done), self._route, self._page_ids, self._aux_slot
        aux = None
        if any(s.aux_bytes for s in done.values()):
            if slot is None:
                return self._fail("aux_unexpected")
            aux = read_aux(mgr.aux_ptr(slot), self.room, mgr.config.aux_slot_bytes)
            if aux is None:
                return  # not landed yet (cannot happen over a completed write); retried by the reaper
        if mgr.config.checksum:
            for r in route:
                want = done[r.pp_rank].checksum
                layers = intersect((r.layer_start, r.layer_end), mgr.pool.layers)
                if (
                    want is None
                    or kv_checksum(mgr.pool, pages, layers, done[r.pp_rank].num_tokens) != want
                ):
                    return self._fail("checksum_mismatch", detail=f"prefill rank {r.pp_rank}")
        received = sum(
            (hi - lo) * 2 * done[r.pp_rank].num_tokens * mgr.pool.token_bytes
            for r in route
            for lo, hi in [intersect((r.layer_start, r.layer_end), mgr.pool.layers)]
        )
        with self._lock:
            if self._status != KVPoll.WaitingForInput:
                return
            self._aux = aux
            self._status = KVPoll.Success
            self.finished_at = time.monotonic()
        mgr.stats.add_received(received)
        mgr.stats.add_success(self.room, self.finished_at - self.registered_at, received)

    def check_timeouts(self, now: float) -> None:
        cfg = self._mgr.config
        if (
            self._status == KVPoll.Bootstrapping
            and self._route is None
            and now - self.created_at > cfg.bootstrap_timeout_s
        ):
            self._fail("bootstrap_timeout")
        elif self._status == KVPoll.WaitingForInput:
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
            tell = [r for r in self._route if r.pp_rank not in self._quiet] if self._sent else []
        mgr = self._mgr
        mgr.stats.add_failure(reason.split(":")[0])
        say = mgr.debug if reason.startswith("aborted") else mgr.warn  # aborts are routine
        say("room %d failed: %s %s", self.room, reason, detail)
        for r in tell:
            mgr.send(r.host, r.ctrl_port, KVAbort(self.room, "decode", mgr.pp_rank, reason[:200]))


class DecodeKVManager(KVManagerBase):
    """The KV manager of one decode rank; `dst_slices` are the layer slices of all decode ranks."""

    side = "decode"

    def __init__(
        self,
        config: TransferConfig,
        pool: PoolDesc,
        pp_rank: int,
        dst_slices,
        aux_slots: int = 256,
        engine: MooncakeEngine | None = None,
    ):
        super().__init__(config, pool, pp_rank, aux_slots=aux_slots, engine=engine)
        self.dst_slices = tuple((int(a), int(b)) for a, b in dst_slices)
        if self.dst_slices[pp_rank] != pool.layers:
            raise ValueError(
                f"decode rank {pp_rank}: pool layers {pool.layers} differ from {self.dst_slices[pp_rank]}"
            )
        self._receivers: dict[int, KVReceiver] = {}
        self._clients: dict[str, BootstrapClient] = {}
        self._routes: dict[str, Future] = {}
        self._misses: dict[str, int] = {}
        self._lookups = ThreadPoolExecutor(4, thread_name_prefix=f"kv-route{pp_rank}")
        self._start_threads()

    def create_receiver(self, room: int, bootstrap_addr: str) -> KVReceiver:
        with self._lock:
            if room in self._receivers:
                raise ValueError(f"room {room} already has a receiver (a room is never reused)")
            recv = self._receivers[room] = KVReceiver(self, room, bootstrap_addr)
            fut = self._routes.get(bootstrap_addr)
            if fut is None or (fut.done() and fut.exception() is not None):
                fut = self._routes[bootstrap_addr] = self._lookups.submit(
                    self._lookup, bootstrap_addr
                )
        fut.add_done_callback(recv.on_route)
        return recv

    def clear_aux(self, ptr: int) -> None:
        ctypes.memset(ptr, 0, AUX_HEADER.size)

    def _client(self, addr: str) -> BootstrapClient:
        with self._lock:
            if addr not in self._clients:
                self._clients[addr] = BootstrapClient(
                    addr, self.config.auth_token, min(2.0, self.config.heartbeat_interval_s * 2)
                )
            return self._clients[addr]

    def _lookup(self, addr: str) -> list[PrefillRankInfo]:
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        return self._client(addr).route(
            self.pool.layer_start, self.pool.layer_end, self.session_id, deadline
        )

    def _on_message(self, msg: Message, sender: str) -> None:
        if isinstance(msg, KVRegister) or (isinstance(msg, KVAbort) and msg.side != "prefill"):
            self.stats.add_dropped("unexpected")
            return
        recv = self._receivers.get(msg.room)
        if recv is None:
            self.stats.add_dropped("unknown_room")
        elif not recv.is_peer(msg.rank if isinstance(msg, KVAbort) else msg.src_rank, sender):
            self._drop(
                "foreign_peer",
                "room %d: %s from %s, not a prefill rank of the room, dropped",
                msg.room,
                type(msg).__name__,
                sender,
            )
        elif isinstance(msg, KVAbort):
            recv.note_quiet(msg.rank)  # first: no KVAbort goes back to the rank that sent it
            recv._fail("aborted_by_prefill", detail=msg.reason)
        else:
            recv.on_status(msg)

    def _tick(self, now: float) -> None:
        with self._lock:
            receivers = list(self._receivers.values())
            for r in receivers:
                if r.finished_at is not None and now - r.finished_at > self.config.terminal_ttl_s:
                    del self._receivers[r.room]
        for r in receivers:
            if r.finished_at is None:
                r.check_timeouts(now)

    def _heartbeat(self) -> None:
        """Beats to every bootstrap server this rank has used (so prefill ranks there see it alive),
        and fails the rooms whose prefill peers went silent or whose server stayed unreachable."""
        with self._lock:
            active = [r for r in self._receivers.values() if r.finished_at is None]
            addrs = sorted(self._clients)
        by_addr: dict[str, list[KVReceiver]] = {a: [] for a in addrs}
        for r in active:
            by_addr.setdefault(r.bootstrap_addr, []).append(r)
        for addr, recvs in by_addr.items():
            peers = sorted({s for r in recvs for s in r.prefill_sessions()})
            try:
                dead, registered = self._client(addr).heartbeat(self.session_id, peers)
                dead = set(dead)
                self._misses[addr] = 0
                # A cached route naming a session the server no longer has is stale: the node was
                # restarted on the same address with new ranks. Without this check the route would
                # outlive the restart whenever no room of ours was active when the old ranks died.
                stale = self._cached_sessions(addr) - registered
                if stale:
                    self.info("prefill node %s has new ranks; looking its route up again", addr)
                    dead |= stale
            except Exception as e:
                self._misses[addr] = self._misses.get(addr, 0) + 1
                if self._misses[addr] < self.config.heartbeat_misses:
                    continue
                self.warn(
                    "bootstrap server %s unreachable for %d beats: %s", addr, self._misses[addr], e
                )
                dead = set(peers)
                for r in recvs:
                    if r.poll() == KVPoll.WaitingForInput:
                        r._fail("bootstrap_lost")
                if not recvs:  # forget a server nobody uses any more
                    with self._lock:
                        self._routes.pop(addr, None)
                        client = self._clients.pop(addr, None)
                    self._misses.pop(addr, None)
                    if client is not None:
                        client.close()
            if dead:
                with self._lock:
                    self._routes.pop(addr, None)  # the node will re-register with new sessions
                for r in recvs:
                    if dead.intersection(r.prefill_sessions()):
                        r._fail("peer_dead")

    def _cached_sessions(self, addr: str) -> set[str]:
        with self._lock:
            fut = self._routes.get(addr)
        if fut is None or not fut.done() or fut.cancelled() or fut.exception() is not None:
            return set()
        return {r.session_id for r in fut.result()}

    def close(self) -> None:
        super().close()
        self._lookups.shutdown(wait=False, cancel_futures=True)
        for c in self._clients.values():
            c.close()
