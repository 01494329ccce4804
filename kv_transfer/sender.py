"""Prefill side: one KVSender per room on every prefill rank, owned by a PrefillKVManager.

Sender states (KVPoll):
  Bootstrapping    waiting for every decode rank that needs this rank's layers to register
                   (the registrations say which decode slices exist)       -> bootstrap timeout
  WaitingForInput  all registered; waiting for the scheduler's first chunk -> waiting timeout
  Transferring     chunks are written in order by a transfer thread; a chunk in flight longer than
                   the transfer timeout, a failed write or a dead peer fails the room
  Success          the last chunk and the aux data landed on every decode peer, then Success was
                   sent to each of them
  Failed           terminal; the decode peers are told (KVStatus Failed, or KVAbort on abort)
The scheduler only calls `send_chunk`, `poll` and `abort`; none of them waits on the network.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from consensus.kvpoll import KVPoll
from kv_transfer.bootstrap import PrefillRankInfo
from kv_transfer.bootstrap_client import BootstrapClient, BootstrapTimeout
from kv_transfer.checksum import kv_checksum
from kv_transfer.engine import MooncakeEngine, TransferError
from kv_transfer.layout import (
    LAYOUT_NAME,
    PoolDesc,
    build_descriptors,
    check_compatible,
    intersect,
    overlapping,
)
from kv_transfer.manager import AUX_HEADER, KVManagerBase, TransferConfig, sender_id, write_aux
from kv_transfer.messages import KVAbort, KVRegister, KVStatus, Message

KNOWN_PEERS_KEPT = 4096  # decode managers whose registered pool a prefill rank remembers


@dataclass(frozen=True)
class Chunk:
    page_ids: tuple
    token_start: int
    token_end: int
    last: bool
    aux: bytes | None


class KVSender:
    def __init__(self, mgr: PrefillKVManager, room: int):
        self.room = room
        self._mgr = mgr
        self._lock = threading.Lock()
        self._status = KVPoll.Bootstrapping
        self.reason: str | None = None
        self._peers: dict[int, KVRegister] = {}
        self._expected: frozenset[int] | None = None
        self._chunks: deque[Chunk] = deque()
        self._busy = False
        self._deferred: tuple[str, bool] | None = (
            None  # failure notice held back while a write runs
        )
        self._last_queued = False
        now = time.monotonic()
        self.created_at, self._progress_at, self._inflight_since = now, now, None
        self._first_chunk_at: float | None = None
        self.finished_at: float | None = None
        self.bytes_sent = 0  # KV bytes written for this room (transfer threads, one at a time)

    def poll(self) -> KVPoll:
        return self._status

    def send_chunk(
        self,
        page_ids,
        token_start: int,
        token_end: int,
        last: bool = False,
        aux: bytes | None = None,
    ) -> None:
        """Queues tokens [token_start, token_end) for all decode peers (page_ids: this rank's page
        table of the request from token 0). On the last chunk, `aux` (the first token and its
        logprobs) is written after the KV and before Success."""
        if self._last_queued:
            raise ValueError(f"room {self.room}: chunk after the last one")
        if not 0 <= token_start <= token_end:
            raise ValueError(f"room {self.room}: bad token range [{token_start}, {token_end})")
        with self._lock:
            if self._status == KVPoll.Failed:
                return
            self._chunks.append(
                Chunk(tuple(int(p) for p in page_ids), token_start, token_end, last, aux)
            )
            self._last_queued = last
        self._kick()

    def abort(self, reason: str = "aborted") -> None:
        self._fail(reason, abort=True)

    # ---- called by the manager's threads ----------------------------------------------------

    def on_register(self, msg: KVRegister) -> None:
        mgr = self._mgr
        mine = mgr.pool.layers
        try:
            check_compatible(mgr.pool, msg.pool)
            if msg.session_id in mgr.failed_sessions:
                raise ValueError(f"session {msg.session_id} failed before and is not reused")
            own_slice = msg.dst_slices[msg.dst_rank] if msg.dst_rank < len(msg.dst_slices) else None
            if own_slice != msg.pool.layers or intersect(mine, own_slice) is None:
                raise ValueError(
                    f"decode rank {msg.dst_rank} with layers {msg.pool.layers} does not "
                    f"overlap {mine} or its slice list"
                )
            expected = frozenset(
                r for r, _, _ in overlapping(mine, dict(enumerate(msg.dst_slices)))
            )
        except ValueError as e:
            mgr.warn(
                "room %d: bad registration from decode rank %d: %s", self.room, msg.dst_rank, e
            )
            mgr.send(
                msg.ctrl_host,
                msg.ctrl_port,
                _status(self.room, mgr.pp_rank, KVPoll.Failed, "bad_registration"),
            )
            self._fail("bad_registration")
            return
        with self._lock:
            late = self._status == KVPoll.Failed
            dup = (
                not late and msg.dst_rank in self._peers
            )  # a later registration never redirects writes
            if not late and not dup:
                if self._expected is not None and expected != self._expected:
                    self._expected = frozenset()  # inconsistent decode layouts: fail below
                self._expected = self._expected if self._expected is not None else expected
                self._peers[msg.dst_rank] = msg
                if (
                    self._expected
                    and set(self._peers) == self._expected
                    and self._status == KVPoll.Bootstrapping
                ):
                    self._status = KVPoll.WaitingForInput
                    self._progress_at = time.monotonic()
        if dup:
            mgr.stats.add_dropped("duplicate_register")
            mgr.warn("room %d: decode rank %d registered again; ignored", self.room, msg.dst_rank)
        elif late:
            mgr.send(
                msg.ctrl_host,
                msg.ctrl_port,
                _status(self.room, mgr.pp_rank, KVPoll.Failed, self.reason or "failed"),
            )
        elif self._expected == frozenset():
            self._fail("bad_registration")
        else:
            self._kick()

    def peer_sessions(self) -> list[str]:
        with self._lock:
            return [p.session_id for p in self._peers.values()]

    def check_timeouts(self, now: float) -> None:
        cfg = self._mgr.config
        status, since = self._status, self._inflight_since
        if status == KVPoll.Bootstrapping and now - self.created_at > cfg.bootstrap_timeout_s:
            self._fail("bootstrap_timeout")
        elif since is not None and now - since > cfg.transfer_timeout_s:
            self._fail("transfer_timeout")
        elif (
            status in (KVPoll.WaitingForInput, KVPoll.Transferring)
            and since is None
            and not self._chunks
            and now - self._progress_at > cfg.waiting_timeout_s
        ):
            self._fail("waiting_timeout")

    def _fail(self, reason: str, abort: bool = False) -> None:
        with self._lock:
            if self._status in (KVPoll.Failed, KVPoll.Success):
                return
            self._status, self.reason = KVPoll.Failed, reason
            self._chunks.clear()
            self.finished_at = time.monotonic()
            peers = list(self._peers.values())
            if self._busy:
                # A write may still be on the wire: the peers hear of the failure when it returned,
                # so a terminal message from this rank means it never writes into their pages again.
                self._deferred, peers = (reason, abort), []
        mgr = self._mgr
        mgr.stats.add_failure(reason)
        say = mgr.debug if reason.startswith("aborted") else mgr.warn  # aborts are routine
        say("room %d failed: %s", self.room, reason)
        self._notify(peers, reason, abort)

    def _notify(self, peers: list[KVRegister], reason: str, abort: bool) -> None:
        mgr = self._mgr
        for p in peers:
            msg = (
                KVAbort(self.room, "prefill", mgr.pp_rank, reason)
                if abort
                else _status(self.room, mgr.pp_rank, KVPoll.Failed, reason)
            )
            mgr.send(p.ctrl_host, p.ctrl_port, msg)

    def is_peer(self, dst_rank: int, sender: str) -> bool:
        """Whether `sender` is the decode manager that registered as `dst_rank` in this room."""
        with self._lock:
            p = self._peers.get(dst_rank)
        return p is not None and sender_id(p.session_id, p.ctrl_port) == sender

    def on_decode_abort(self, dst_rank: int) -> None:
        """The decode side gave up the room; it waits for a terminal message before reusing pages."""
        with self._lock:
            quiet = self._status in (KVPoll.Failed, KVPoll.Success) and not self._busy
            peer = self._peers.get(dst_rank)
        if not quiet:
            self._fail("aborted_by_decode")
        elif peer is not None:
            self._mgr.send(
                peer.ctrl_host,
                peer.ctrl_port,
                _status(
                    self.room, self._mgr.pp_rank, KVPoll.Failed, self.reason or "aborted_by_decode"
                ),
            )

    def _kick(self) -> None:
        with self._lock:
            if (
                self._busy
                or not self._chunks
                or self._status not in (KVPoll.WaitingForInput, KVPoll.Transferring)
            ):
                return
            self._busy = True
        self._mgr.pool_executor.submit(self._drain)

    def _drain(self) -> None:
        while True:
            with self._lock:
                if self._status == KVPoll.Failed or not self._chunks:
                    self._busy = False
                    deferred, self._deferred = self._deferred, None
                    peers = list(self._peers.values())
                    done = True
                else:
                    done = False
            if done:
                if deferred is not None:
                    self._notify(peers, *deferred)
                return
            with self._lock:
                chunk = self._chunks.popleft()
                self._status = KVPoll.Transferring
                self._inflight_since = time.monotonic()
                if self._first_chunk_at is None:
                    self._first_chunk_at = self._inflight_since
                peers = sorted(self._peers.items())
            try:
                self._send(chunk, peers)
            except (TransferError, ValueError) as e:
                self._mgr.warn("room %d: transfer failed: %s", self.room, e)
                if isinstance(e, TransferError) and e.session_id:
                    self._mgr.failed_sessions.add(e.session_id)  # a failed session is not reused
                self._fail("transfer_error" if isinstance(e, TransferError) else "bad_chunk")
            finally:
                with self._lock:
                    self._inflight_since = None
                    self._progress_at = time.monotonic()

    def _send(self, chunk: Chunk, peers: list[tuple[int, KVRegister]]) -> None:
        mgr, cfg = self._mgr, self._mgr.config
        stop = lambda: self._status == KVPoll.Failed  # noqa: E731
        for _, p in peers:
            if p.session_id in mgr.failed_sessions:
                # A peer that already failed another room fails this one at once, instead of holding a
                # transfer thread (and the healthy peers' rooms queued behind it) in another write.
                raise TransferError(f"session {p.session_id} failed before", p.session_id)
            descs = build_descriptors(
                mgr.pool, p.pool, chunk.page_ids, p.page_ids, chunk.token_start, chunk.token_end
            )
            moved = mgr.engine.write(p.session_id, descs, cfg.max_inflight_descriptors, stop)
            mgr.stats.add_write(len(descs), moved)
            self.bytes_sent += moved
        if not chunk.last:
            return
        aux_bytes = {}
        for _, p in peers:
            aux_bytes[p.dst_rank] = (
                mgr.write_aux(self.room, chunk.aux, p, stop) if chunk.aux is not None else 0
            )
        sums = {}
        if cfg.checksum:
            for _, p in peers:
                sums[p.dst_rank] = kv_checksum(
                    mgr.pool,
                    chunk.page_ids,
                    intersect(mgr.pool.layers, p.pool.layers),
                    chunk.token_end,
                )
        with self._lock:
            if self._status == KVPoll.Failed:
                return
            self._status = KVPoll.Success
            self.finished_at = time.monotonic()
        for _, p in peers:
            mgr.send(
                p.ctrl_host,
                p.ctrl_port,
                KVStatus(
                    self.room,
                    mgr.pp_rank,
                    int(KVPoll.Success),
                    "",
                    chunk.token_end,
                    aux_bytes[p.dst_rank],
                    sums.get(p.dst_rank),
                ),
            )
        mgr.stats.add_success(self.room, self.finished_at - self._first_chunk_at, self.bytes_sent)


def _status(room: int, rank: int, status: KVPoll, reason: str) -> KVStatus:
    return KVStatus(room, rank, int(status), reason[:200], 0, 0, None)


class PrefillKVManager(KVManagerBase):
    """The KV manager of one prefill rank: registers with its node's bootstrap server, owns senders."""

    side = "prefill"

    def __init__(
        self,
        config: TransferConfig,
        pool: PoolDesc,
        pp_rank: int,
        pp_size: int,
        bootstrap_addr: str,
        engine: MooncakeEngine | None = None,
    ):
        super().__init__(config, pool, pp_rank, aux_slots=config.transfer_threads, engine=engine)
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
        self._aux_free: queue.Queue[int] = queue.Queue()
        for i in range(self.aux_slots):
            self._aux_free.put(i)
        self.pool_executor = ThreadPoolExecutor(
            config.transfer_threads, thread_name_prefix=f"kv-send{pp_rank}"
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
        )
        self._bootstrap = BootstrapClient(
            bootstrap_addr, config.auth_token, config.heartbeat_interval_s
        )
        self.registered = threading.Event()
        self._misses = 0  # heartbeats in a row the bootstrap server did not answer
        self._threads.append(
            threading.Thread(
                target=self._register, name=f"kv-prefill{pp_rank}-register", daemon=True
            )
        )
        self._start_threads()

    def _register(self) -> None:
        try:
            self._bootstrap.register(self.info_record, stop=self._stop)
            self.registered.set()
            self.debug(
                "registered with bootstrap server %s (layers [%d, %d))",
                self._bootstrap.addr,
                self.pool.layer_start,
                self.pool.layer_end,
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
                sender = self._senders.get(msg.room)
                if sender is None:
                    self._pending.setdefault(msg.room, []).append((time.monotonic(), msg))
                    return
            sender.on_register(msg)
        elif isinstance(msg, KVAbort) and msg.side == "decode":
            with self._lock:
                room = self._senders.get(msg.room)
                withdrawn = self._withdraw(msg.room, msg.rank, sender) if room is None else []
            if withdrawn:
                # The decode rank gave the room up before this rank had its sender: the registration
                # is gone (a sender created later must not write into those pages, which the decode
                # side reuses), the sender will fail at once, and the decode rank gets its final word.
                for m in withdrawn:
                    self.send(
                        m.ctrl_host,
                        m.ctrl_port,
                        _status(msg.room, self.pp_rank, KVPoll.Failed, "aborted_by_decode"),
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
        """Under the lock: removes the pending registrations of decode rank `dst_rank` by `sender` in
        `room` (a sender created later fails at once); returns them."""

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
        if len(msg.page_ids) > msg.pool.num_pages or any(
            p >= msg.pool.num_pages for p in msg.page_ids
        ):
            return "bad_pages"
        if (msg.aux_ptr, msg.aux_len) != (0, 0) and not (
            msg.aux_base <= msg.aux_ptr and msg.aux_ptr + msg.aux_len <= msg.aux_base + msg.aux_size
        ):
            return "bad_aux"
        place = (msg.pool, msg.dst_rank, msg.dst_slices, msg.ctrl_host, msg.aux_base, msg.aux_size)
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
                            _status(room, self.pp_rank, KVPoll.Failed, "unknown_room"),
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
            dead = set(self._bootstrap.heartbeat(self.session_id, peers)[0])
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
        if dead:
            self.failed_sessions.update(dead)
            for s in active:
                if dead.intersection(s.peer_sessions()):
                    s._fail("peer_dead")

    def close(self) -> None:
        super().close()
        self.pool_executor.shutdown(wait=False, cancel_futures=True)
        self._bootstrap.close()
