"""The KV manager of a prefill rank: registers the rank with its node's bootstrap server, checks and
keeps the decode ranks' registrations, creates one KVSender per room, and runs the control and
heartbeat threads (kv_transfer/sender.py has one room's sender)."""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from pdserve.consensus.kvpoll import KVPoll
from pdserve.kv_transfer.base import BasePrefillKVManager
from pdserve.kv_transfer.bootstrap import PrefillRankInfo
from pdserve.kv_transfer.bootstrap_client import BootstrapClient, BootstrapTimeout
from pdserve.kv_transfer.layout import LAYOUT_NAME, PoolDesc
from pdserve.kv_transfer.manager import (
    AUX_HEADER,
    KVManagerBase,
    TransferConfig,
    sender_id,
    write_aux,
)
from pdserve.kv_transfer.messages import KVAbort, KVRegister, Message
from pdserve.kv_transfer.mooncake import MooncakeEngine
from pdserve.kv_transfer.sender import KVSender, _status
from pdserve.kv_transfer.targets import check_split
from pdserve.kv_transfer.tcp_transport import TcpTransferEngine

KNOWN_PEERS_KEPT = 4096  # decode managers whose registered pool a prefill rank remembers


class PrefillKVManager(KVManagerBase, BasePrefillKVManager):
    """The KV manager of one prefill rank: registers with the bootstrap server, owns senders."""

    side = "prefill"

    def __init__(
        self,
        config: TransferConfig,
        pool: PoolDesc,
        pp_rank: int,
        pp_size: int,
        bootstrap_addr: str,
        engine: MooncakeEngine | TcpTransferEngine | None = None,
        tp: tuple[int, int] = (0, 1),
    ):
        super().__init__(
            config, pool, pp_rank, aux_slots=config.transfer_threads, engine=engine, tp=tp
        )
        self.pp_size = pp_size
        self.failed_sessions: set[str] = set()
        self._senders: dict[int, KVSender] = {}
        self._pending: dict[
            int, list[tuple[float, KVRegister]]
        ] = {}  # registrations before create_sender
        self._withdrawn: dict[int, float] = {}  # rooms a decode rank aborted while pending: when
        # Each decode manager's pool and place, as its first authenticated registration gave them:
        # later registrations must name the same, so none can point writes at other memory.
        self._known_peers: OrderedDict[str, tuple] = OrderedDict()
        # When each decode session last registered a room here (monotonic s): a registration is
        # proof of life, newer than what the bootstrap server saw if the session has not beaten it
        # since a stall (a heartbeat verdict of "silent" then is stale).
        self._registered_at: OrderedDict[str, float] = OrderedDict()
        self._aux_free: queue.Queue[int] = queue.Queue()
        for i in range(self.aux_slots):
            self._aux_free.put(i)
        self.pool_executor = ThreadPoolExecutor(
            config.transfer_threads, thread_name_prefix=f"kv-send{self.rank}"
        )
        self.info_record = PrefillRankInfo(
            pp_rank,
            pp_size,
            pool.layer_start,
            pool.layer_end,
            config.host,
            self.ctrl_port,
            self.session_id,
            pool.page_size,
            pool.token_bytes,
            pool.dtype,
            LAYOUT_NAME,
            self.tp_rank,
            self.tp_size,
            *pool.heads,
        )
        self._bootstrap = BootstrapClient(
            bootstrap_addr, config.auth_token, config.heartbeat_interval_s
        )
        self.registered = threading.Event()
        self._misses = 0  # heartbeats in a row the bootstrap server did not answer
        self._threads.append(
            threading.Thread(
                target=self._register, name=f"kv-prefill{self.rank}-register", daemon=True
            )
        )
        self._start_threads()

    def _register(self) -> None:
        try:
            self._bootstrap.register(self.info_record, stop=self._stop)
            self.registered.set()
            self.debug(
                "registered with bootstrap server %s (layers [%d, %d), KV heads [%d, %d))",
                self._bootstrap.addr,
                self.pool.layer_start,
                self.pool.layer_end,
                *self.pool.heads,
            )
        except (BootstrapTimeout, ValueError) as e:
            self.warn("bootstrap registration stopped: %s", e)

    def create_sender(self, room: int) -> KVSender:
        with self._lock:
            if room in self._senders:
                raise ValueError(f"room {room} already has a sender (a room is never reused)")
            sender = self._senders[room] = KVSender(self, room)
            pending = self._pending.pop(room, [])
            withdrawn = self._withdrawn.pop(room, None) is not None
        for _, msg in pending:
            sender.on_register(msg)
        if withdrawn:
            sender._fail("aborted_by_decode")  # tells the decode ranks still registered
        return sender

    def write_aux(self, room: int, aux: bytes, peer: KVRegister, stop) -> int:
        if AUX_HEADER.size + len(aux) > peer.aux_len:
            raise ValueError(
                f"aux data of {len(aux)} bytes does not fit the decode slot of {peer.aux_len}"
            )
        slot = self._aux_free.get()
        try:
            ptr = self.aux_ptr(slot)
            n = write_aux(ptr, room, aux)
            self.engine.write(peer.session_id, [(ptr, peer.aux_ptr, n)], 1, stop)
        finally:
            self._aux_free.put(slot)
        return len(aux)

    def _on_message(self, msg: Message, sender: str) -> None:
        if isinstance(msg, KVRegister):
            reason = self._check_register(msg, sender)
            if reason is not None:
                self._drop(
                    reason, "room %d: registration from %s dropped: %s", msg.room, sender, reason
                )
                return
            with self._lock:
                self._registered_at[msg.session_id] = time.monotonic()
                self._registered_at.move_to_end(msg.session_id)
                if len(self._registered_at) > KNOWN_PEERS_KEPT:
                    self._registered_at.popitem(last=False)
                kv_sender = self._senders.get(msg.room)
                if kv_sender is None:
                    self._pending.setdefault(msg.room, []).append((time.monotonic(), msg))
                    return
            kv_sender.on_register(msg)
        elif isinstance(msg, KVAbort) and msg.side == "decode":
            with self._lock:
                room = self._senders.get(msg.room)
                withdrawn = self._withdraw(msg.room, msg.rank, sender) if room is None else []
            if withdrawn:
                # The decode rank gave the room up before this rank had its sender: the registration
                # is gone (a sender created later must not write into those pages, which the
                # decode side reuses), the sender will fail at once, and the decode rank gets its
                # final word.
                for m in withdrawn:
                    self.send(
                        m.ctrl_host,
                        m.ctrl_port,
                        _status(msg.room, self.rank, KVPoll.Failed, "aborted_by_decode"),
                    )
            elif room is None:
                self.stats.add_dropped("unknown_room")
            elif not room.is_peer(msg.rank, sender):
                self._drop(
                    "foreign_peer",
                    "room %d: abort from %s, not a decode rank of the room, dropped",
                    msg.room,
                    sender,
                )
            else:
                room.on_decode_abort(msg.rank)
        else:
            self.stats.add_dropped("unexpected")

    def _withdraw(self, room: int, dst_rank: int, sender: str) -> list[KVRegister]:
        """Under the lock: removes the pending registrations of decode rank `dst_rank` by `sender`
        in `room` (a sender created later fails at once); returns them."""

        def its(m: KVRegister) -> bool:
            return m.dst_rank == dst_rank and sender_id(m.session_id, m.ctrl_port) == sender

        regs = self._pending.get(room, [])
        mine = [m for _, m in regs if its(m)]
        if mine:
            rest = [(t, m) for t, m in regs if not its(m)]
            if rest:
                self._pending[room] = rest
            else:
                del self._pending[room]
            self._withdrawn[room] = time.monotonic()  # kept as long as a pending registration
        return mine

    def _check_register(self, msg: KVRegister, sender: str) -> str | None:
        """Why `msg` from `sender` is refused, or None: a decode manager registers only itself
        (the session and control port inside the MAC), always with the pool, rank and aux buffer it
        first registered, and with page ids and an aux slot inside them."""
        if sender != sender_id(msg.session_id, msg.ctrl_port):
            return "foreign_peer"
        if _bad_pages(msg.pool, msg.page_ids):
            return "bad_pages"
        if msg.sliding_pool is not None:
            try:
                check_split(msg.pool, msg.sliding_pool)
            except ValueError:
                return "bad_pages"
            if _bad_pages(msg.sliding_pool, msg.sliding_page_ids):
                return "bad_pages"
        if (msg.aux_ptr, msg.aux_len) != (0, 0) and not (
            msg.aux_base <= msg.aux_ptr and msg.aux_ptr + msg.aux_len <= msg.aux_base + msg.aux_size
        ):
            return "bad_aux"
        place = (
            msg.pool,
            msg.sliding_pool,
            msg.dst_rank,
            msg.dst_slices,
            msg.ctrl_host,
            msg.aux_base,
            msg.aux_size,
        )
        with self._lock:
            known = self._known_peers.setdefault(sender, place)
            self._known_peers.move_to_end(sender)
            if len(self._known_peers) > KNOWN_PEERS_KEPT:
                self._known_peers.popitem(last=False)
        return None if known == place else "pool_changed"

    def _tick(self, now: float) -> None:
        ttl = self.config.terminal_ttl_s
        with self._lock:
            senders = list(self._senders.values())
            for room, since in list(self._withdrawn.items()):
                if now - since > self.config.bootstrap_timeout_s:
                    del self._withdrawn[room]
            for room, regs in list(self._pending.items()):
                if now - regs[0][0] > self.config.bootstrap_timeout_s:
                    del self._pending[room]
                    self.stats.add_dropped("unknown_room")
                    for _, m in regs:
                        self.send(
                            m.ctrl_host,
                            m.ctrl_port,
                            _status(room, self.rank, KVPoll.Failed, "unknown_room"),
                        )
            for s in senders:
                if s.finished_at is not None and now - s.finished_at > ttl:
                    del self._senders[s.room]
        for s in senders:
            if s.finished_at is None:
                s.check_timeouts(now)

    def _heartbeat(self) -> None:
        with self._lock:
            active = [s for s in self._senders.values() if s.finished_at is None]
        peers = sorted({p for s in active for p in s.peer_sessions()})
        try:
            beat = self._bootstrap.heartbeat(self.session_id, peers)
        except Exception as e:  # our own node's server; nothing to fail, say so
            # One miss is no news: the server lives in the node's front process, which can be
            # too busy to answer within the beat (a start-up importing the tokenizer's libraries
            # next to it); its peers count a session dead only after heartbeat_timeout_s.
            self._misses += 1
            say = self.warn if self._misses == self.config.heartbeat_misses else self.debug
            say(
                "heartbeat to bootstrap server %s failed %d times in a row: %s",
                self._bootstrap.addr,
                self._misses,
                e,
            )
            return
        if self._misses >= self.config.heartbeat_misses:
            self.info("heartbeat to bootstrap server %s answered again", self._bootstrap.addr)
        self._misses = 0
        dead = self._silent(beat.dead, beat.timeout_s)
        if dead:
            self.failed_sessions.update(dead)
            for s in active:
                if dead.intersection(s.peer_sessions()):
                    s._fail("peer_dead")

    def _silent(self, dead: list[str], timeout_s: float) -> set[str]:
        """The sessions of `dead` (silent on the bootstrap server for over `timeout_s`) that did not
        register a room here within `timeout_s` either. A decode rank back from a stall may
        register before its heartbeat reaches this server: its new rooms must not fail on the
        stale verdict."""
        now = time.monotonic()
        with self._lock:
            heard = {s: self._registered_at.get(s) for s in dead}
        return {s for s, t in heard.items() if t is None or now - t > timeout_s}

    def close(self) -> None:
        super().close()
        self.pool_executor.shutdown(wait=False, cancel_futures=True)
        self._bootstrap.close()


def _bad_pages(pool: PoolDesc, page_ids) -> bool:
    return len(page_ids) > pool.num_pages or any(p >= pool.num_pages for p in page_ids)
