"""Prefill side: one KVSender per room on every prefill rank, owned by a PrefillKVManager.

Sender states (KVPoll):
  Bootstrapping    waiting for every decode rank that needs this rank's layers and heads to register
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

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.consensus.kvpoll import KVPoll
from pdserve.kv_transfer.base import BaseKVSender
from pdserve.kv_transfer.checksum import kv_checksum
from pdserve.kv_transfer.layout import (
    PoolDesc,
    check_compatible,
    intersect,
    window_start,
)
from pdserve.kv_transfer.manager import sender_id
from pdserve.kv_transfer.messages import KVAbort, KVRegister, KVStatus
from pdserve.kv_transfer.mooncake import TransferError
from pdserve.kv_transfer.stats import room_tokens
from pdserve.kv_transfer.targets import target_descriptors, targets

if TYPE_CHECKING:
    from pdserve.kv_transfer.prefill_manager import PrefillKVManager


@dataclass(frozen=True)
class Chunk:
    page_ids: tuple
    token_start: int
    token_end: int
    last: bool
    aux: bytes | None
    total_tokens: int = 0  # the whole transfer's tokens (0: unknown, no window skip)


class KVSender(BaseKVSender):
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
        self._inflight_since: float | None
        self.created_at, self._progress_at, self._inflight_since = now, now, None
        self._first_chunk_at: float | None = None
        self.finished_at: float | None = None
        self.bytes_sent = 0  # KV bytes written for this room (transfer threads, one at a time)
        self.descriptors = 0  # Mooncake write descriptors of this room (traces only)

    def poll(self) -> KVPoll:
        return self._status

    @property
    def first_chunk_at(self) -> float | None:
        """When the first chunk went on the wire (monotonic s); with `finished_at`, the span of
        this rank's transfer (traces only)."""
        return self._first_chunk_at

    def send_chunk(
        self,
        page_ids,
        token_start: int,
        token_end: int,
        last: bool = False,
        aux: bytes | None = None,
        total_tokens: int = 0,
    ) -> None:
        """Queues tokens [token_start, token_end) for all decode peers (page_ids: this rank's page
        table of the request from token 0; `total_tokens`: BaseKVSender.send_chunk). On the last
        chunk, `aux` (the first token and its logprobs) is written after the KV and before
        Success."""
        if self._last_queued:
            raise ValueError(f"room {self.room}: chunk after the last one")
        if not 0 <= token_start <= token_end:
            raise ValueError(f"room {self.room}: bad token range [{token_start}, {token_end})")
        with self._lock:
            if self._status == KVPoll.Failed:
                return
            self._chunks.append(
                Chunk(
                    tuple(int(p) for p in page_ids), token_start, token_end, last, aux, total_tokens
                )
            )
            self._last_queued = last
        self._kick()

    def abort(self, reason: str = "aborted") -> None:
        self._fail(reason, abort=True)

    # ---- called by the manager's threads ----------------------------------------------------

    def on_register(self, msg: KVRegister) -> None:
        mgr = self._mgr
        try:
            check_compatible(mgr.pool, msg.pool)
            if msg.sliding_pool is not None:
                check_compatible(mgr.pool, msg.sliding_pool)
            if msg.session_id in mgr.failed_sessions:
                # A registration is proof of life: a session declared dead (a stalled process, a
                # starved CPU) or that failed a write is used again, or PD would stay down for good.
                # Its earlier rooms failed already; a new one fails again if it really is dead.
                mgr.failed_sessions.discard(msg.session_id)
                mgr.info("session %s registers again: writing to it again", msg.session_id)
            expected = _expected_ranks(mgr.pool, msg)
        except ValueError as e:
            mgr.warn(
                "room %d: bad registration from decode rank %d: %s", self.room, msg.dst_rank, e
            )
            self._reply_failed(msg, "bad_registration")
            self._fail("bad_registration")
            return
        with self._lock:
            late = self._status == KVPoll.Failed
            dup = (
                not late and msg.dst_rank in self._peers
            )  # a later registration never redirects writes
            mismatch = not late and not dup and _prefix_differs(self._peers, msg)
            if not late and not dup and not mismatch:
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
            self._reply_failed(msg, self.reason or "failed")
        elif mismatch:
            mgr.warn("room %d: decode ranks registered different cached prefixes", self.room)
            self._reply_failed(msg, "prefix_mismatch")
            self._fail("prefix_mismatch")
        elif self._expected == frozenset():
            self._fail("bad_registration")
        else:
            self._kick()

    def _reply_failed(self, msg: KVRegister, reason: str) -> None:
        """Tells the decode rank that sent `msg` this room failed here, for `reason`."""
        mgr = self._mgr
        mgr.send(msg.ctrl_host, msg.ctrl_port, _status(self.room, mgr.rank, KVPoll.Failed, reason))

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
                KVAbort(self.room, "prefill", mgr.rank, reason)
                if abort
                else _status(self.room, mgr.rank, KVPoll.Failed, reason)
            )
            mgr.send(p.ctrl_host, p.ctrl_port, msg)

    def is_peer(self, dst_rank: int, sender: str) -> bool:
        """Whether `sender` is the decode manager that registered as `dst_rank` in this room."""
        with self._lock:
            p = self._peers.get(dst_rank)
        return p is not None and sender_id(p.session_id, p.ctrl_port) == sender

    def on_decode_abort(self, dst_rank: int) -> None:
        """The decode side gave up the room; it waits for a final message before reusing pages."""
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
                    self.room, self._mgr.rank, KVPoll.Failed, self.reason or "aborted_by_decode"
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
                    to_tell = list(self._peers.values())
                    done = True
                else:
                    done = False
            if done:
                if deferred is not None:
                    self._notify(to_tell, *deferred)
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
        mgr = self._mgr
        stop = lambda: self._status == KVPoll.Failed  # noqa: E731
        self._write_kv(chunk, peers, stop)
        if not chunk.last:
            return
        aux_bytes = {}
        for _, p in peers:
            aux_bytes[p.dst_rank] = (
                mgr.write_aux(self.room, chunk.aux, p, stop) if chunk.aux is not None else 0
            )
        sums = self._checksums(chunk, peers) if mgr.config.checksum else {}
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
                    mgr.rank,
                    int(KVPoll.Success),
                    "",
                    chunk.token_end,
                    aux_bytes[p.dst_rank],
                    sums.get(p.dst_rank),
                ),
            )
        assert self._first_chunk_at is not None  # _drain sets it before it sends a chunk
        mgr.stats.add_success(self.room, self.finished_at - self._first_chunk_at, self.bytes_sent)
        mgr.stats.add_room_tokens(*room_tokens(mgr.pool, [p for _, p in peers], chunk.token_end))

    def _write_kv(
        self, chunk: Chunk, peers: list[tuple[int, KVRegister]], stop: Callable[[], bool]
    ) -> None:
        """Writes `chunk`'s KV to each peer in turn, counting what moved."""
        mgr, cfg = self._mgr, self._mgr.config
        for _, p in peers:
            if p.session_id in mgr.failed_sessions:
                # A peer that already failed another room fails this one at once, instead of
                # holding a transfer thread (and the healthy peers' rooms queued behind it) in
                # another write.
                raise TransferError(f"session {p.session_id} failed before", p.session_id)
            descs = [
                d
                for t in targets(p, chunk.total_tokens)
                for d in target_descriptors(
                    mgr.pool,
                    t,
                    chunk.page_ids,
                    (chunk.token_start, chunk.token_end),
                    chunk.total_tokens,
                )
            ]
            moved = mgr.engine.write(p.session_id, descs, cfg.max_inflight_descriptors, stop)
            mgr.stats.add_write(len(descs), moved)
            self.descriptors += len(descs)
            self.bytes_sent += moved

    def _checksums(self, chunk: Chunk, peers: list[tuple[int, KVRegister]]) -> dict[int, int]:
        """dst_rank -> the checksum of the KV written to that peer, for its Success message."""
        mgr, sums = self._mgr, {}
        for _, p in peers:
            layers = intersect(mgr.pool.layers, p.pool.layers)
            heads = intersect(mgr.pool.heads, p.pool.heads)
            assert layers and heads  # on_register accepts only peers overlapping this rank
            sums[p.dst_rank] = kv_checksum(
                mgr.pool,
                chunk.page_ids,
                layers,
                chunk.token_end,
                token_start=p.prefix_tokens,
                slide_from=window_start(chunk.token_end, p.pool.window, p.pool.page_size),
                heads=heads,
            )
        return sums


def _expected_ranks(mine: PoolDesc, msg: KVRegister) -> frozenset[int]:
    """The decode ranks whose slices (as `msg` lists them) overlap the layers and KV heads of this
    rank's pool `mine`. ValueError when `msg` is not a valid registration: its cached prefix is
    not page-aligned, or its own slice is not its pool's layers and heads or does not overlap
    `mine`."""
    if msg.prefix_tokens % msg.pool.page_size:
        raise ValueError(f"prefix of {msg.prefix_tokens} tokens is not page-aligned")

    def overlaps(s: tuple) -> bool:
        return bool(intersect(mine.layers, s[:2]) and intersect(mine.heads, s[2:]))

    own = msg.dst_slices[msg.dst_rank] if msg.dst_rank < len(msg.dst_slices) else None
    if own != (*msg.pool.layers, *msg.pool.heads) or not overlaps(own):
        raise ValueError(
            f"decode rank {msg.dst_rank} with layers {msg.pool.layers} and heads "
            f"{msg.pool.heads} does not overlap {mine.layers}/{mine.heads} or its slice list"
        )
    return frozenset(r for r, s in enumerate(msg.dst_slices) if overlaps(s))


def _prefix_differs(peers: dict, msg) -> bool:
    """Whether `msg` names another cached prefix than the decode ranks registered before it (every
    decode rank of a room matches the same prefix; a difference is a bug, and fails the room)."""
    return any(p.prefix_tokens != msg.prefix_tokens for p in peers.values())


def _status(room: int, rank: int, status: KVPoll, reason: str) -> KVStatus:
    return KVStatus(room, rank, int(status), reason[:200], 0, 0, None)
